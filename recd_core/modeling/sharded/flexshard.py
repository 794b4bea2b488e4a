"""FlexShard's placement of a sequence table (Sethi et al., 2023), and the all-to-all traffic
each placement causes: rows are not equal, so the hottest are replicated and the rest
sharded row by row, within the memory the row-wise plan it replaces may use.

Each row of a table is in one tier, by its access count over the training days:

    hot    a copy on every rank: its lookups are local; the gradients of the touched hot
           rows are combined across all ranks each step (sparse all-reduce)
    warm   a copy on every node, sharded over the node's ranks: lookups cross only the fast
           link inside a node; the touched warm rows' gradients are combined across nodes
    cold   one copy, sharded over all ranks (snake order by count: each rank the same
           number of rows and about the same expected traffic)

Memory per rank, in rows: hot + warm / per_node + cold / world, no more than the budget
(`budget_rows`, at least the row-wise plan's ceil(rows / world)). The budget's slack buys
warm rows first (per row of memory they save per_node times the cross-node lookups a hot
row does), then promotes the hottest warm rows to hot with what is left; a row is copied
only when its lookups saved outweigh its gradient's sync (`worth_copying`): a copy of a
row looked up less than about once a step per copy costs more than it saves.

The traffic model (`traffic`) replays each rank's lookups of one step through a placement:
for a sequence table every looked-up id goes to the rank serving its row (8 bytes), and its
vector comes back (forward) and its gradient goes there (backward), 4 bytes a dimension each;
plus the replicas' gradient sync (ring all-reduce of the rows touched that step). Each byte
is counted once, as cross-node when the two ranks are on different nodes. TorchRec's
row-wise plan (contiguous row blocks) and table-wise plan (a whole table on one rank) are
modelled alike, so the three are compared on the same lookups (bench/flexshard.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recd_core.errors import BadInput

HOT, WARM, COLD = 0, 1, 2
ID_BYTES = 8


class RowBudgetRefused(BadInput):
    """The budget cannot hold the table even sharded row-wise."""


@dataclass(frozen=True)
class Placement:
    """Where each row of one table lives (module doc):

    tier   int8 [rows]   HOT, WARM or COLD
    slot   int64 [rows]  COLD: the rank holding it; WARM: the rank within each node
                         holding its node's copy; HOT: -1
    """

    tier: np.ndarray
    slot: np.ndarray
    world: int
    per_node: int

    def rows_per_rank(self) -> np.ndarray:
        """The rows each rank holds (its memory, in rows)."""
        held = np.full(self.world, int(np.sum(self.tier == HOT)), np.int64)
        cold = np.bincount(self.slot[self.tier == COLD], minlength=self.world)
        warm_local = np.bincount(self.slot[self.tier == WARM], minlength=self.per_node)
        return held + cold[: self.world] + np.tile(warm_local, self.world // self.per_node)

    def holds(self, rank: int) -> np.ndarray:
        """Whether `rank` holds each row (a copy or the one)."""
        local = rank % self.per_node
        return (self.tier == HOT) | np.where(
            self.tier == WARM, self.slot == local, self.slot == rank
        )

    def keeps(self, rank: int) -> np.ndarray:
        """Whether `rank` holds the copy of each row that leaves the run (a saved model, a
        checkpoint): a cold row's one, a warm row's on the first node, a hot row's on rank 0.
        Every row is kept by exactly one rank."""
        first_node = rank < self.per_node
        return np.where(
            self.tier == HOT,
            rank == 0,
            np.where(self.tier == WARM, first_node & (self.slot == rank), self.slot == rank),
        )

    def server(self, rank: int, ids: np.ndarray) -> np.ndarray:
        """The rank that serves each of `ids` to `rank`."""
        tier, slot = self.tier[ids], self.slot[ids]
        node_base = (rank // self.per_node) * self.per_node
        return np.where(tier == HOT, rank, np.where(tier == WARM, node_base + slot, slot))


def _snake(n: int, parts: int) -> np.ndarray:
    """0, 1, ..., parts-1, parts-1, ..., 0, 0, 1, ...: for items sorted by weight, each part
    gets every parts-th of them, and about the same total weight."""
    cycle = np.concatenate([np.arange(parts), np.arange(parts)[::-1]])
    return np.resize(cycle, n)


def row_wise(rows: int, world: int, per_node: int) -> Placement:
    """TorchRec's row-wise plan: contiguous blocks of ceil(rows / world) rows."""
    block = -(-rows // world)
    slot = np.arange(rows, dtype=np.int64) // block
    return Placement(np.full(rows, COLD, np.int8), slot, world, per_node)


def table_wise(rows: int, world: int, per_node: int, rank: int) -> Placement:
    """TorchRec's table-wise plan: the whole table on `rank`."""
    slot = np.full(rows, rank, np.int64)
    return Placement(np.full(rows, COLD, np.int8), slot, world, per_node)


def worth_copying(counts: np.ndarray, steps: int, copies: int, dim: int):
    """Whether a copy of each row on `copies` places (every rank, or every node) saves more
    bytes than it costs: its lookups a step (`counts / steps`, Poisson) stop crossing to the
    one owner, but every step that touches it combines its gradient over the copies (a ring:
    2 (copies - 1) rows). A row looked up less than about `copies` times a step is not."""
    lam = counts / max(steps, 1)
    vector = 8 * dim  # forward and backward, float32
    saved = lam * (copies - 1) / copies * (ID_BYTES + vector)
    synced = -np.expm1(-lam) * 2 * (copies - 1) * 4 * dim
    return saved > synced


def flexshard(
    counts: np.ndarray, world: int, per_node: int, budget_rows: int, steps: int = 1, dim: int = 32
) -> Placement:
    """The tiers of a table whose rows were looked up `counts` times over `steps` steps, on
    `world` ranks of `per_node` per node, each holding at most `budget_rows` rows (module
    doc); only rows whose copies pay for their gradient sync are copied."""
    rows = len(counts)
    if world % per_node:
        raise BadInput(f"{world} ranks do not split into nodes of {per_node}")
    floor = -(-rows // world)
    if budget_rows < floor:
        raise RowBudgetRefused(
            f"a budget of {budget_rows:,} rows a rank cannot hold {rows:,} rows on {world} "
            f"ranks (row-wise needs {floor:,})"
        )
    order = np.argsort(-counts, kind="stable")  # hottest first
    nodes = world // per_node

    def memory(hot: int, warm: int) -> int:  # rows on the fullest rank (`warm` counts hot)
        return hot + -(-(warm - hot) // per_node) + -(-(rows - warm) // world)

    slack = budget_rows - floor  # rows of memory a rank may spend on copies
    n_warm = n_hot = 0
    ranked = counts[order]
    worth_hot = int(worth_copying(ranked, steps, world, dim).sum())
    if world > 1 and nodes > 1:  # a warm row costs 1/per_node - 1/world of a row a rank
        worth_warm = int(worth_copying(ranked, steps, nodes, dim).sum())
        cost = 1 / per_node - 1 / world
        n_warm = min(worth_warm, int(slack / cost)) if cost > 0 else 0
        while n_warm and memory(0, n_warm) > budget_rows:
            n_warm -= 1
        if per_node > 1:  # what is left promotes the hottest warm rows to every rank
            room = int((budget_rows - memory(0, n_warm)) / (1 - 1 / per_node))
            n_hot = min(n_warm, worth_hot, room)
    elif world > 1:  # one node: a copy on every rank is the only tier worth paying for
        n_hot = n_warm = min(worth_hot, int(slack / (1 - 1 / world)))
    while n_hot and memory(n_hot, n_warm) > budget_rows:
        n_hot -= 1
    tier = np.full(rows, COLD, np.int8)
    tier[order[:n_warm]] = WARM
    tier[order[:n_hot]] = HOT
    slot = np.full(rows, -1, np.int64)
    warm, cold = order[tier[order] == WARM], order[tier[order] == COLD]
    slot[warm] = _snake(len(warm), per_node)
    slot[cold] = _snake(len(cold), world)
    return Placement(tier, slot, world, per_node)


@dataclass
class Traffic:
    """Bytes one step sends between ranks, summed over ranks; `cross` the part between
    nodes. ids: the lookups' ids; vectors: their embeddings forward and gradients backward;
    sync: the replicas' gradient all-reduce."""

    ids: float = 0.0
    vectors: float = 0.0
    sync: float = 0.0
    cross: float = 0.0

    @property
    def total(self) -> float:
        return self.ids + self.vectors + self.sync

    def add(self, other: Traffic) -> None:
        self.ids += other.ids
        self.vectors += other.vectors
        self.sync += other.sync
        self.cross += other.cross


def traffic(placement: Placement, lookups: list[np.ndarray], dim: int) -> Traffic:
    """The bytes of one step in which rank r looks up `lookups[r]` (ids, one per lookup)."""
    p, world = placement.per_node, placement.world
    out = Traffic()
    vector = 2 * 4 * dim  # forward embedding and backward gradient
    touched_hot: set[int] = set()
    touched_warm: set[int] = set()
    for rank, ids in enumerate(lookups):
        if not len(ids):
            continue
        server = placement.server(rank, ids)
        remote = server != rank
        cross = remote & (server // p != rank // p)
        out.ids += ID_BYTES * float(remote.sum())
        out.vectors += vector * float(remote.sum())
        out.cross += (ID_BYTES + vector) * float(cross.sum())
        tier = placement.tier[ids]
        touched_hot.update(np.unique(ids[tier == HOT]).tolist())
        touched_warm.update(np.unique(ids[tier == WARM]).tolist())
    row, nodes = 4 * dim, world // p
    if world > 1 and touched_hot:  # a ring all-reduce over all ranks: 2 (w - 1) row copies,
        sync = 2 * (world - 1) * row * len(touched_hot)  # `nodes` of the w links between nodes
        out.sync += sync
        out.cross += sync * nodes / world if nodes > 1 else 0.0
    if nodes > 1 and touched_warm:  # a ring over the nodes' copies: every link between nodes
        sync = 2 * (nodes - 1) * row * len(touched_warm)
        out.sync += sync
        out.cross += sync
    return out
