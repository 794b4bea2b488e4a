"""A DLRM's tables as every strategy and the saved format name them: which tables, the
features that look each up, and each one's key in a single-process model's state dict (the
layout a saved model, a checkpoint's gathered state and a warm start share)."""

from __future__ import annotations

from dataclasses import dataclass


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
            specs.append(
                TableSpec(
                    f"h_{n}", model.table_sizes[n], (n,), f"history.{n}.embedding.weight", 3**0.5
                )
            )
    return specs
