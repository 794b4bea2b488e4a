"""The DLRM's tables placed by FlexShard (flexshard.py: the tiers), trained exactly.

A step, for all tables at once (one `_Lookup`: the same collectives on every rank, in order):

    rank r's ids ──┬─ hot rows ───────────── its own copy (no bytes sent)
                   ├─ warm rows ── to the node's rank holding the node's copy
                   └─ cold rows ── to the one rank holding the row
        ids ── all-to-all ──▶ served ── vectors ── all-to-all ──▶ rank r      (forward)
        rank r's gradients ── all-to-all ──▶ each row's server, summed per row (backward)
        copies' gradients combined: hot rows over every rank, warm rows over each slot's
        ranks across nodes (a sparse all-reduce: the union of the rows touched, nothing
        else), then every copy takes the same row-wise Adagrad step

so every copy of a row sees the same gradient and stays equal to the others, and a run ends
where the row-wise plan ends (the update is FBGEMM's EXACT_ROWWISE_ADAGRAD's: acc +=
mean(g^2), w -= lr g / (sqrt(acc) + eps), g the row's gradient summed over the ranks and
divided by N, the batch's gradient as one process has it: each rank's loss is scaled by N
times its share of the batch, for DDP's mean). The update runs in the backward pass, as
TorchRec's fused one does (state.py's `FusedAdagrad` is the loop's view of it).

The tables leave the run (a saved model, a checkpoint) in TorchRec's row-wise boxes
(`exported`: each row's kept copy sent to the rank whose block holds it), so whatever reads
a sharded model reads this one; a model or checkpoint of any placement comes back by rows
(`load_full`): on any N, any placement.

The collectives run on a process group of their own, so their order never interleaves with
DDP's all-reduces of the dense part. `sent` counts the bytes this rank sends (ids, vectors
and gradients exactly; the sync as a ring all-reduce sends them: 2 (n-1)/n of the tensor).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from recd_core.dpp.batch_store import Batch
from recd_core.modeling.shard_files import ROW_BLOCK
from recd_core.modeling.sharded.flexshard import HOT, WARM, Placement
from recd_core.modeling.tables import TableSpec


class FlexShardTables(nn.Module):
    """This rank's rows of every table under its FlexShard placement. `forward(batch)` ->
    each id feature's per-id vectors in the order of its rows' ids ([nnz, d]), as
    tables.py's `ShardedTables` gives them.

    Per table i:  held[i]    int64 [n_i]     the rows this rank holds, ascending
                  weights[i] float32 [n_i, d] their vectors (plain tensors: no DDP param)
                  accs[i]    float32 [n_i]    their Adagrad accumulators
    weights[i] and accs[i] are views of `all_weights` [sum n_i, d] and `all_accs`, where a
    step finds its rows with one index (`local`: a row's key -> its place there).
    """

    def __init__(
        self,
        specs: list[TableSpec],
        dim: int,
        placements: list[Placement],
        rank: int,
        device: torch.device,
        lr: float,
        seed: int = 0,
    ):
        super().__init__()
        self.specs, self.dim, self.placements = specs, dim, placements
        self.rank, self.world = rank, placements[0].world
        self.per_node = placements[0].per_node
        self.device, self.lr, self.eps = device, lr, 1e-10
        self.table_of = {f: i for i, s in enumerate(specs) for f in s.features}
        self.held = [np.flatnonzero(p.holds(rank)) for p in placements]
        # a row of any table is keyed `offsets[table] + row`; this rank's held rows sit in
        # one tensor, table after table (`weights[i]` is its view of table i)
        self.offsets = np.cumsum([0] + [s.rows for s in specs])
        starts = np.cumsum([0] + [len(h) for h in self.held])
        self.held_key = np.concatenate(
            [o + h for o, h in zip(self.offsets[:-1], self.held, strict=True)]
        )
        self.local = np.full(self.offsets[-1], -1, np.int64)  # key -> its place (-1: none)
        self.local[self.held_key] = np.arange(len(self.held_key))
        self.server = np.concatenate(  # key -> the rank serving it to this one
            [p.server(rank, np.arange(len(p.tier))).astype(np.int32) for p in placements]
        )
        self.tier = np.concatenate([p.tier for p in placements])
        self.all_weights = torch.cat(
            [
                fresh_rows(s, dim, held, seed * 1_000_003 + i)
                for i, (s, held) in enumerate(zip(specs, self.held, strict=True))
            ]
        ).to(device)
        self.all_accs = torch.zeros(len(self.held_key), device=device)
        spans = list(zip(starts[:-1], starts[1:], strict=True))
        self.weights = [self.all_weights[a:b] for a, b in spans]  # views
        self.accs = [self.all_accs[a:b] for a, b in spans]
        self.group = dist.new_group()  # the tables' own collectives (module doc)
        self.node_group = None  # the ranks holding the same warm slot, one a node
        nodes = self.world // self.per_node
        if nodes > 1:
            slots = [[n * self.per_node + k for n in range(nodes)] for k in range(self.per_node)]
            self.node_group, _ = dist.new_subgroups_by_enumeration(slots)
        # whether any table has copies to combine (the same on every rank: it skips
        # collectives)
        self.copied = {tt: any((p.tier == tt).any() for p in placements) for tt in (HOT, WARM)}
        self.sent: Counter = Counter()
        # seconds spent in the tables' parts of the steps (a step's breakdown, the bench's):
        # `lookup` (forward), `backward` (gradients to the servers, the sync, the update)
        self.timed: Counter = Counter()

    # -- a step ---------------------------------------------------------------------------
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        looked = id_features(batch)
        names, values = [n for n, _ in looked], [v for _, v in looked]
        tables = [self.table_of[n] for n in names]
        out = self._lookup(tables, values)
        return dict(zip(names, out.split([len(v) for v in values]), strict=True))

    def _lookup(self, tables: list[int], values: list[torch.Tensor]) -> torch.Tensor:
        """Every feature's ids (`values`, of `tables`) looked up: [sum of ids, d]."""
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        return _Lookup.apply(anchor, self, tables, values)

    def keys_of(self, tables: list[int], values: list[torch.Tensor]) -> np.ndarray:
        """Each id keyed across tables: `offsets[table] + row`."""
        tab = np.concatenate(
            [np.zeros(0, np.int64)]
            + [np.full(len(v), t, np.int64) for t, v in zip(tables, values, strict=True)]
        )
        ids = np.concatenate(
            [np.zeros(0, np.int64)] + [v.detach().cpu().numpy().astype(np.int64) for v in values]
        )
        return self.offsets[tab] + ids

    def keys_of_parts(self, batch: Batch, parts: int) -> list[np.ndarray]:
        """`keys_of_parts` of this run's tables."""
        return keys_of_parts(batch, parts, self.offsets, self.table_of)

    def _route_keys(self, keys: np.ndarray):
        """Each key to the rank serving it (8 bytes an id, whatever its table): (the send
        order, counts sent and received, the received keys' places among this rank's held
        rows). A collective."""
        server = self.server[keys]
        order = np.argsort(server, kind="stable")
        send = np.bincount(server, minlength=self.world)
        recv = self._exchange_counts(send)
        got = self._all_to_all(torch.from_numpy(keys[order]), send, recv, "ids").numpy()
        pos = self.local[got]
        if (pos < 0).any():
            raise RuntimeError("an id was sent to a rank that does not hold its row")
        return order, send, recv, pos

    def _exchange_counts(self, send: np.ndarray, group=None) -> np.ndarray:
        recv = torch.empty(self.world, dtype=torch.int64)
        dist.all_to_all_single(recv, torch.from_numpy(send), group=group or self.group)
        return recv.numpy()

    def _all_to_all(
        self, x: torch.Tensor, send, recv, what: str, group=None, sent: Counter | None = None
    ) -> torch.Tensor:
        """`x`'s rows, `send[j]` to rank j, on `group` (the tables'), counted in `sent` (the
        tables')."""
        out = x.new_empty((int(recv.sum()), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), recv.tolist(), send.tolist(), group or self.group
        )
        row = x[0].numel() * x.element_size() if len(x) else 0
        (self.sent if sent is None else sent)[what] += row * int(send.sum() - send[self.rank])
        return out

    def _serve(self, pos: np.ndarray) -> torch.Tensor:
        return self.all_weights[torch.from_numpy(pos).to(self.device)]

    @torch.no_grad()
    def _update(self, pos: np.ndarray, grads: torch.Tensor) -> None:
        """The served rows' gradients, summed per row, the copies' combined (all tables in
        one sparse all-reduce a tier), one Adagrad step on every copy of every row touched
        anywhere."""
        pos, g = self._summed(pos, grads)
        tier = self.tier[self.held_key[pos]]
        for tt, group in ((HOT, self.group), (WARM, self.node_group)):
            if group is None or not self.copied[tt]:
                continue
            copies = tier == tt
            keys, summed = self._sum_over(group, self.held_key[pos[copies]], g[_index(copies, g)])
            keep = ~copies
            pos = np.concatenate([pos[keep], self.local[keys]])
            g = torch.cat([g[_index(keep, g)], summed])
            tier = np.concatenate([tier[keep], np.full(len(keys), -1, np.int8)])
        self._adagrad(torch.from_numpy(pos).to(self.device), g / self.world)

    @staticmethod
    def _summed(keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        rows, inverse = np.unique(keys, return_inverse=True)
        g = grads.new_zeros(len(rows), grads.shape[1])
        g.index_add_(0, torch.from_numpy(inverse).to(grads.device), grads)
        return rows, g

    def _sum_over(self, group, ids: np.ndarray, g: torch.Tensor):
        """(the union of `ids` over `group`'s ranks, each one's gradient summed over them): a
        sparse all-reduce (every rank of the group calls it)."""
        n = dist.get_world_size(group)
        count = torch.tensor([len(ids)], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(counts, count, group=group)
        width = int(max(c.item() for c in counts))
        padded = torch.full((width,), -1, dtype=torch.int64)
        padded[: len(ids)] = torch.from_numpy(ids)
        every = [torch.empty(width, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(every, padded, group=group)
        union = np.unique(torch.cat(every).numpy())
        union = union[union >= 0]
        dense = g.new_zeros(len(union), self.dim)
        dense[torch.from_numpy(np.searchsorted(union, ids)).to(g.device)] = g
        dist.all_reduce(dense, group=group)
        ring = 2 * (n - 1) / n * dense.numel() * dense.element_size()
        self.sent["sync"] += 8 * width * (n - 1) + int(ring)  # the ids gathered, the ring
        return union, dense

    def _adagrad(self, rows: torch.Tensor, g: torch.Tensor) -> None:
        if not len(rows):
            return
        acc, w = self.all_accs, self.all_weights
        acc.index_add_(0, rows, g.pow(2).mean(1))
        scale = self.lr / (acc.index_select(0, rows).sqrt() + self.eps)
        w.index_add_(0, rows, -scale.unsqueeze(1) * g)

    # -- the state, as the loop and the files see it ---------------------------------------
    def local_weights(self) -> list[torch.Tensor]:
        return list(self.weights)

    def local_accumulators(self) -> list[torch.Tensor]:
        return list(self.accs)

    def placement_table(self) -> dict[str, str]:
        """Where each table went (the run's summary): its tiers' rows."""
        out = {}
        for s, p in zip(self.specs, self.placements, strict=True):
            hot, warm = int((p.tier == HOT).sum()), int((p.tier == WARM).sum())
            out[s.name] = (
                f"flexshard on ranks 0-{self.world - 1}: {hot:,} rows hot, {warm:,} warm, "
                f"{s.rows - hot - warm:,} cold"
            )
        return out

    def exported(self, weights=None, accumulators=None):
        """(boxes, weights, accumulators) of this rank in TorchRec's row-wise blocks (the
        loop's `weights` and `accumulators` of this rank, or the live ones): each row's kept
        copy (`Placement.keeps`) sent to its block's rank. A collective."""
        weights = weights if weights is not None else self.weights
        accumulators = accumulators if accumulators is not None else self.accs
        boxes, ws, accs = [], [], []
        for t, (s, p) in enumerate(zip(self.specs, self.placements, strict=True)):
            kept = p.keeps(self.rank)[self.held[t]]
            ids = self.held[t][kept]
            block = -(-s.rows // self.world)
            dest = ids // block
            order = np.argsort(dest, kind="stable")
            send = np.bincount(dest, minlength=self.world)
            recv = self._exchange_counts(send)
            mine = torch.from_numpy(np.flatnonzero(kept)[order])
            got_ids = self._all_to_all(torch.from_numpy(ids[order]), send, recv, "export")
            got_w = self._all_to_all(weights[t].detach().cpu()[mine], send, recv, "export")
            acc = accumulators[t].detach().cpu().reshape(-1)
            got_a = self._all_to_all(acc[mine], send, recv, "export")
            r0 = self.rank * block
            nr = max(min(block, s.rows - r0), 0)
            if len(got_ids) != nr:
                raise RuntimeError(f"{s.name}: {len(got_ids)} rows came to a block of {nr}")
            if nr:
                at = torch.argsort(got_ids)
                boxes.append((t, [r0, 0], [nr, self.dim]))
                ws.append(got_w[at])
                accs.append(got_a[at])
        return boxes, ws, accs

    def local_of(self, full: list, accumulators: list | None = None):
        """This rank's held rows of tables in the single-process layout (tensors or
        shard_files' lazy tables; `accumulators` likewise): (weights, accumulators), in
        `local_weights` order."""
        ws = [_rows(f, torch.from_numpy(h)) for f, h in zip(full, self.held, strict=True)]
        accs = None
        if accumulators is not None:
            accs = [
                _rows(a, torch.from_numpy(h)) for a, h in zip(accumulators, self.held, strict=True)
            ]
        return ws, accs

    @torch.no_grad()
    def load_full(self, full: list | None = None, accumulators: list | None = None) -> None:
        """Tables and/or their accumulators in the single-process layout (any placement's,
        any N) into this rank's rows, ROW_BLOCK rows at a time."""
        for t, held in enumerate(self.held):
            for source, target in ((full, self.weights), (accumulators, self.accs)):
                if source is None:
                    continue
                for lo in range(0, len(held), ROW_BLOCK):
                    ids = torch.from_numpy(held[lo : lo + ROW_BLOCK])
                    target[t][lo : lo + len(ids)] = _rows(source[t], ids).to(self.device)
                if hasattr(source[t], "release"):  # the pages read: not kept resident
                    source[t].release()


def _index(mask: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(mask)).to(like.device)


def _rows(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (ascending) of a tensor or of a shard file's lazy table or accumulator."""
    if hasattr(table, "rows"):
        return table.rows(ids)
    return table[ids]


def fresh_rows(spec: TableSpec, dim: int, held: np.ndarray, seed: int) -> torch.Tensor:
    """Rows `held` of a fresh table, uniform(-bound, bound), drawn row block by row block
    from `seed`: the same rows whatever the placement or N."""
    out = torch.empty(len(held), dim)
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, spec.rows, ROW_BLOCK):
        hi = min(lo + ROW_BLOCK, spec.rows)
        block = torch.empty(hi - lo, dim).uniform_(-spec.init_bound, spec.init_bound, generator=gen)
        a, b = np.searchsorted(held, [lo, hi])
        if b > a:
            out[a:b] = block[torch.from_numpy(held[a:b] - lo)]
    return out


class _Lookup(torch.autograd.Function):
    """Every table's lookups of a step in one exchange (module doc); backward sends the
    gradients to the rows' servers and updates every copy there."""

    @staticmethod
    def forward(ctx, anchor, tables: FlexShardTables, which: list[int], values: list):
        t0 = time.perf_counter()
        order, send, recv, pos = tables._route_keys(tables.keys_of(which, values))
        served = tables._serve(pos)
        back = tables._all_to_all(served, recv, send, "vectors")
        out = torch.empty_like(back)
        out[torch.from_numpy(order).to(back.device)] = back
        ctx.tables, ctx.route = tables, (order, send, recv, pos)
        tables.timed["lookup"] += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        tables = ctx.tables
        order, send, recv, pos = ctx.route
        grads = tables._all_to_all(
            grad[torch.from_numpy(order).to(grad.device)], send, recv, "gradients"
        )
        tables._update(pos, grads)
        tables.timed["backward"] += time.perf_counter() - t0
        return None, None, None, None


def id_features(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    """(feature, its ids) of every id feature `batch` looks up: per-sample ones, then each
    group's unique rows (once each), as TorchRec's input orders them (tables.py)."""
    kjts = [batch.kjt] if batch.kjt is not None else []
    kjts += [ik.unique for ik in batch.groups.values()]
    return [(name, jt.values) for kjt in kjts for name, jt in kjt.to_dict().items()]


def table_ids(batch: Batch, specs: list[TableSpec]) -> list[np.ndarray]:
    """The ids `batch` looks up in each table (a group's unique rows once)."""
    table_of = {f: i for i, s in enumerate(specs) for f in s.features}
    found: list[list[np.ndarray]] = [[] for _ in specs]
    for name, ids in id_features(batch):
        found[table_of[name]].append(ids.numpy().astype(np.int64))
    return [np.concatenate([np.zeros(0, np.int64), *f]) for f in found]


def keys_of_parts(
    batch: Batch, parts: int, offsets: np.ndarray, table_of: dict
) -> list[np.ndarray]:
    """The rows each of `parts` slices of `batch` (`Batch.part`'s) looks up, keyed across
    tables (`offsets[table_of[feature]] + id`), without slicing the batch (the oracle reads
    every rank's): a per-sample id goes to its sample's slice, a group's unique row to each
    slice whose samples use it: the ids the slice's lookups send (a row read twice, twice),
    in another order."""
    bounds = [q * batch.size // parts for q in range(parts + 1)]
    found: list[list[np.ndarray]] = [[] for _ in range(parts)]
    if batch.kjt is not None:
        for name, jt in batch.kjt.to_dict().items():
            ids = jt.values.numpy().astype(np.int64) + offsets[table_of[name]]
            ends = np.concatenate([[0], np.cumsum(jt.lengths.numpy())])
            for q in range(parts):
                found[q].append(ids[ends[bounds[q]] : ends[bounds[q + 1]]])
    for ik in batch.groups.values():
        inverse = ik.inverse_indices.numpy()
        used = np.zeros((parts, ik.unique.lengths.numel() // len(ik.unique.keys)), bool)
        for q in range(parts):
            used[q, inverse[bounds[q] : bounds[q + 1]]] = True
        for name, jt in ik.unique.to_dict().items():
            ids = jt.values.numpy().astype(np.int64) + offsets[table_of[name]]
            row = np.repeat(np.arange(len(jt.lengths)), jt.lengths.numpy())
            for q in range(parts):
                found[q].append(ids[used[q, row]])
    return [np.concatenate([np.zeros(0, np.int64), *f]) for f in found]


def row_counts(store, specs: list[TableSpec]) -> list[np.ndarray]:
    """Each table's rows' lookups over the training batches of `store` (what the run's
    all-to-alls carry), the same on every rank."""
    out = [np.zeros(s.rows, np.int64) for s in specs]
    for k in range(len(store)):
        for t, ids in enumerate(table_ids(store[k], specs)):
            out[t] += np.bincount(ids, minlength=specs[t].rows)[: specs[t].rows]
    return out
