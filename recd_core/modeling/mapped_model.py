"""`MappedDLRM`: a saved model whose tables stay in their shard files (shard_files.py), for
scoring (evaluate, the registry, serving). Each batch's ids are read from the memory-mapped
shards, each distinct row once, so a process scoring a model with a table it could never
hold pages in the rows the batch looks up, not the table; the rest of the model is the
DLRM's own, the same code the training ran."""

from __future__ import annotations

import torch

from recd_core.config import FeatureSet, ModelConfig
from recd_core.dpp.batch_store import Batch
from recd_core.modeling.model import DLRM
from recd_core.modeling.shard_files import LazyTable
from recd_core.modeling.tables import table_specs


class MappedDLRM(DLRM):
    """The DLRM without tables of its own; `lookup` reads the ids' rows from `tables` (the
    shard files' `LazyTable`s by their key in the single-process state dict). Its
    `state_dict()` is the dense part (what the layout's model.pt holds)."""

    def __init__(self, features: FeatureSet, cfg: ModelConfig, tables: dict[str, LazyTable]):
        super().__init__(features, cfg, tables=False)
        specs = table_specs(self)
        missing = [s.key for s in specs if s.key not in tables]
        wrong = [
            s.key
            for s in specs
            if s.key in tables and tables[s.key].shape != (s.rows, cfg.embedding_dim)
        ]
        if missing or wrong:
            raise RuntimeError(f"the shard files lack tables {missing} or differ in shape {wrong}")
        self.mapped = tables
        self.key_of = {f: s.key for s in specs for f in s.features}

    def lookup(self, batch: Batch) -> dict[str, torch.Tensor]:
        ids = list(batch.kjt.to_dict().items()) if batch.kjt is not None else []
        ids += [item for ik in batch.groups.values() for item in ik.unique.to_dict().items()]
        return {
            name: self.mapped[self.key_of[name]].rows(jt.values).to(jt.values.device)
            for name, jt in ids
        }
