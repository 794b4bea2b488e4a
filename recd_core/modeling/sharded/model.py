"""`ShardedDLRM`: the DLRM with its tables sharded (tables.py), its dense part as usual."""

from __future__ import annotations

import torch
from torch import nn

from recd_core.config import FeatureSet, ModelConfig
from recd_core.dpp.batch_store import Batch
from recd_core.modeling.model import DLRM
from recd_core.modeling.sharded.state import load_full_state
from recd_core.modeling.sharded.tables import ShardedTables
from recd_core.modeling.tables import table_specs


class ShardedDLRM(DLRM):
    """The DLRM with its tables in `ShardedTables` (one lookup a step for every id feature)
    and its dense part as usual. Its `state_dict()` is the dense weights and this rank's
    shards (`sharded.<k>`, plain tensors: what early stopping and the table restarts keep
    per rank); `load_state_dict` takes that, or the single-process layout (a saved model, a
    warm start), scattered to the shards."""

    def __init__(self, features: FeatureSet, cfg: ModelConfig, place=None):
        """`place(specs)`: the tables placed (FlexShard's); else TorchRec's, which its
        DistributedModelParallel places."""
        super().__init__(features, cfg, tables=False)
        specs = table_specs(self)
        self.sharded = place(specs) if place else ShardedTables(specs, cfg.embedding_dim)
        # the per-id vectors of the batch embedded last (feature -> [nnz, d]): the
        # co-occurrence loss reads its lists there, the tables being looked up once a step
        self.looked_up: dict[str, torch.Tensor] = {}

    def lookup(self, batch: Batch) -> dict[str, torch.Tensor]:
        self.looked_up = self.sharded(batch)
        return self.looked_up

    def sparse_parameters(self) -> list[torch.Tensor]:
        """This rank's shards (views of the weights)."""
        return self.sharded.local_weights()

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("sharded.")]

    def dense_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in super().state_dict().items() if not k.startswith("sharded.")}

    def load_dense_state(self, state: dict[str, torch.Tensor]) -> None:
        """Everything but the tables, strictly (TorchRec's loading hooks want the whole
        sharded state, so the tables are left out of the walk)."""
        children = dict(self.named_children())
        children.pop("sharded")
        own = dict(self.named_parameters(recurse=False)) | {
            k: b
            for k, b in self.named_buffers(recurse=False)
            if k not in self._non_persistent_buffers_set
        }
        unexpected = [k for k in state if k.split(".")[0] not in children and k not in own]
        missing = [k for k in own if k not in state]
        if missing or unexpected:
            raise RuntimeError(f"missing keys {missing[:4]}, unexpected keys {unexpected[:4]}")
        for name, child in children.items():
            child.load_state_dict(
                {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".")}
            )
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(state[k])

    def state_dict(self, *args, **kwargs):
        if args or kwargs:  # a module walk (DMP, DDP): the usual
            return super().state_dict(*args, **kwargs)
        shards = {f"sharded.{k}": w.detach() for k, w in enumerate(self.sharded.local_weights())}
        return {**self.dense_state(), **shards}

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        if any(spec.key in state for spec in self.sharded.specs):  # the single-process layout
            return load_full_state(self, state)
        shards = self.sharded.local_weights()
        if any(f"sharded.{k}" not in state for k in range(len(shards))):
            raise RuntimeError("the state holds no shards of this rank (a sharded model's own)")
        self.load_dense_state({k: v for k, v in state.items() if not k.startswith("sharded.")})
        with torch.no_grad():
            for k, w in enumerate(shards):
                w.copy_(state[f"sharded.{k}"])
        return None
