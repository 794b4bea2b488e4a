"""The DLRM's tables as one TorchRec EmbeddingCollection: which tables (`TableSpec`), the
batch as TorchRec's input, and where this rank's shards sit in each table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from recd_core.dpp.batch_store import Batch


@dataclass(frozen=True)
class TableSpec:
    """One table: its name in the EmbeddingCollection, rows, the features that look it up,
    and its key in a single-process model's state dict."""

    name: str
    rows: int
    features: tuple[str, ...]
    key: str
    init_bound: float  # uniform(-bound, bound) for a fresh table


def table_specs(model) -> list[TableSpec]:
    """A DLRM's tables in the order of its `sparse_parameters()` (bags, then the histories'
    own tables), so optimizer states line up with the single-process layout."""
    specs = []
    for table in model.bag_tables:
        feats = [n for n in model.sparse_names if model.table_of[n] == table]
        feats += [n for n in model.sequence_names if model.history_table[n] == table]
        rows = model.table_sizes[feats[0]]
        specs.append(TableSpec(table, rows, tuple(feats), f"bags.{table}.weight", 0.05))
    for n in model.sequence_names:
        if model.history_table[n] is None:  # N(0, 1) in one process: the same variance
            specs.append(TableSpec(f"h_{n}", model.table_sizes[n], (n,),
                                   f"history.{n}.embedding.weight", 3**0.5))  # fmt: skip
    return specs


class ShardedTables(nn.Module):
    """The DLRM's tables as one TorchRec EmbeddingCollection (built on the meta device:
    `DistributedModelParallel` materializes each rank's shards only). `forward(batch)` ->
    each id feature's per-id vectors, in the order of its rows' ids ([nnz, d])."""

    def __init__(self, specs: list[TableSpec], dim: int):
        super().__init__()
        from torchrec import EmbeddingCollection, EmbeddingConfig

        self.specs, self.dim = specs, dim
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=s.name,
                    embedding_dim=dim,
                    num_embeddings=s.rows,
                    feature_names=list(s.features),
                    weight_init_min=-s.init_bound,
                    weight_init_max=s.init_bound,
                )
                for s in specs
            ],  # fmt: skip
            device=torch.device("meta"),
        )

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = self.ec(torchrec_input(batch))
        return {name: jt.values() for name, jt in out.items()}

    # -- this rank's shards ----------------------------------------------------------------
    def live(self) -> dict[str, dict]:
        """Each table's live ShardedTensors, in `specs` order: {"weights": name -> weights,
        "accumulators": name -> the fused Adagrad's per-row accumulators} (a table-wise rank
        without the table has no accumulators for it). Their local shards are views:
        writing them writes the tables."""
        weights = self.ec.state_dict()
        optim = self.ec.fused_optimizer.state_dict()["state"]
        out: dict[str, dict] = {"weights": {}, "accumulators": {}}
        for s in self.specs:
            key = f"embeddings.{s.name}.weight"
            out["weights"][s.name] = weights[key]
            if key in optim:
                (out["accumulators"][s.name],) = optim[key].values()
        return out

    def local_weights(self) -> list[torch.Tensor]:
        """This rank's shards of every table (views: writing them writes the weights)."""
        return local_shards(self.live()["weights"])

    def local_accumulators(self) -> list[torch.Tensor]:
        """The per-row accumulators of this rank's shards (views)."""
        return local_shards(self.live()["accumulators"])

    def boxes(self) -> list[tuple[int, list, list]]:
        """(table index, offsets, sizes) of this rank's shards, in `local_weights` order."""
        weights = self.live()["weights"]
        return [
            (i, list(sh.metadata.shard_offsets), list(sh.metadata.shard_sizes))
            for i, s in enumerate(self.specs)
            for sh in weights[s.name].local_shards()
        ]


def local_shards(sharded: dict) -> list[torch.Tensor]:
    """The local shards of ShardedTensors by name, in order."""
    return [sh.tensor for st in sharded.values() for sh in st.local_shards()]


def torchrec_input(batch: Batch):
    """The batch's id features as one TorchRec KJT of stride B: per-sample keys as they are,
    each group's keys as its unique rows followed by empty ones (see the module)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrecKJT

    keys, values, lengths = [], [], []
    size = batch.size
    if batch.kjt is not None:
        keys += batch.kjt.keys
        values.append(batch.kjt.values)
        lengths.append(batch.kjt.lengths)
    for ik in batch.groups.values():
        pad = size - ik.num_unique
        for name, jt in ik.unique.to_dict().items():
            keys.append(name)
            values.append(jt.values)
            lengths += [jt.lengths, jt.lengths.new_zeros(pad)]
    return TrecKJT(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
