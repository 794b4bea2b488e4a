"""The DLRM's tables as one TorchRec EmbeddingCollection (which tables: `modeling/tables.py`), the
batch as TorchRec's input, and where this rank's shards sit in each table."""

from __future__ import annotations

import torch
from torch import nn

from recd_core.dpp.batch_store import Batch
from recd_core.modeling.shard_files import ROW_BLOCK
from recd_core.modeling.tables import TableSpec


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
            ],
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

    # -- the state as it leaves and comes back (flexshard_tables.py answers the same) ------
    def exported(self, weights=None, accumulators=None):
        """(boxes, weights, accumulators): this rank's shards (the loop's copies of them,
        or the live ones) and where they sit in their tables."""
        weights = weights if weights is not None else self.local_weights()
        if accumulators is None:
            accumulators = self.local_accumulators()
        return self.boxes(), weights, accumulators

    def local_of(self, full: list, accumulators: list | None = None):
        """This rank's boxes of tables in the single-process layout (tensors or shard
        files' lazy tables; `accumulators` likewise): (weights, accumulators)."""
        boxes = self.boxes()
        ws = [full[i][r0 : r0 + nr, c0 : c0 + nc] for i, (r0, c0), (nr, nc) in boxes]
        accs = None
        if accumulators is not None:
            accs = [accumulators[i][r0 : r0 + nr] for i, (r0, _), (nr, _) in boxes]
        return ws, accs

    @torch.no_grad()
    def load_full(self, full: list | None = None, accumulators: list | None = None) -> None:
        """Tables and/or their accumulators in the single-process layout into this rank's
        shards, in row blocks: a shard file's box is not read into memory whole beside the
        shard, nor are the file's pages kept resident."""
        boxes = self.boxes()
        if full is not None:
            for (i, (r0, c0), (nr, nc)), w in zip(boxes, self.local_weights(), strict=True):
                for lo in range(0, nr, ROW_BLOCK):
                    hi = min(lo + ROW_BLOCK, nr)
                    w[lo:hi].copy_(full[i][r0 + lo : r0 + hi, c0 : c0 + nc])
                    if hasattr(full[i], "release"):
                        full[i].release()
        if accumulators is not None:
            for (i, (r0, _), (nr, _)), a in zip(boxes, self.local_accumulators(), strict=True):
                a.view(-1)[:nr].copy_(accumulators[i][r0 : r0 + nr])
                if hasattr(accumulators[i], "release"):
                    accumulators[i].release()


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
