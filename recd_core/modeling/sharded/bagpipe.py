"""BagPipe's oracle cacher (Agarwal et al., 2023) on recd's batches: DPP writes a day's batches
before training starts, so the rows every step will read are known; each rank keeps, within a
cache budget, the remote rows its next `lookahead` steps read, fetched ahead of use where the
row's last update allows, so the step's lookups of them are local.

The cache a rank holds while step s runs (`plan`), Belady within the lookahead: the remote
rows it reads at s, then the rows it already holds that it reads again within the next k
steps, nearest next use first, up to the `budget`; a row is fetched for the step that reads
it (as late as it can be, so as few copies as can go stale), a held row read beyond the
lookahead or whose next use falls out of the budget is evicted, and a row another rank reads
(so updates) before this rank's next use is let go (the oracle sees every rank's batches:
the copy would be stale). Exact (as synchronous as the uncached run, BagPipe's
guarantee: bagpipe_tables.py trains with it), so a cached copy is never read stale:

    a row fetched (entering the   its id goes to its owner, its weights and accumulator
      cache, or held but stale)   come back (8 + 4 (d + 1) bytes): during step s-1,
                                  overlapped, unless a rank reads (so updates) the row at
                                  s-1; then after it, on step s's critical path
    a held row another rank       stale: fetched again before its next use
      reads at a step
    a held row the rank reads     its gradient goes to the row's owner (write-through, 8 +
                                  4 d bytes) with the step's other gradients, so the owner
                                  stays the authority: on the critical path (BagPipe
                                  overlaps the ones nobody reads at the next step; here
                                  they go with the step's backward, as bagpipe_tables.py
                                  sends them); a row only this rank read takes the same
                                  step in the cache, with no bytes
    a remote row not held         the uncached lookup: its id, its vector, its gradient
                                  (8 + 8 d bytes), on the critical path

Rows are those remote under a placement (row-wise, or FlexShard's: the cache then covers
what it did not copy). `replay` sums the bytes over ranks and steps: the critical path's,
the prefetched (overlapped) ones, and the hit rate, beside the uncached critical path of
the same lookups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recd_core.modeling.sharded.flexshard import ID_BYTES, Placement


@dataclass
class CacheBytes:
    """One table's bytes over the replayed steps, summed over ranks."""

    critical: float = 0.0  # on the steps' critical path, with the cache
    prefetched: float = 0.0  # fetched or refreshed overlapped with the step before
    uncached: float = 0.0  # the critical path without a cache (every remote read)
    hits: int = 0
    remote: int = 0  # remote reads in all


def plan(
    remote: list[np.ndarray],
    s: int,
    lookahead: int,
    budget: int,
    others: list[np.ndarray] | None = None,
    held: np.ndarray | None = None,
) -> np.ndarray:
    """The rows held while step s runs: the rows `remote[s]` reads (one rank's remote reads
    a step, unique), then of the `held` rows (fresh copies from before) those read again
    within `remote[s+1 .. s+k-1]`, nearest next use first, `budget` in all, ties by id: a
    row is fetched for the step that reads it (during the step before, overlapped), and the
    lookahead decides what stays (Belady: the farthest next use goes first). With `others`
    (the rows other ranks read, a step each, from s on), a row another rank reads before
    this rank's next use does not stay: its copy would be stale by then."""
    window = remote[s : s + lookahead]
    if not window or budget <= 0:
        return np.zeros(0, np.int64)
    rows = np.concatenate(window)
    step = np.repeat(np.arange(len(window)), [len(w) for w in window])
    rows, first = np.unique(rows, return_index=True)  # each row's first step: its next use
    use = step[first]
    keep = use == 0
    if held is not None:
        keep |= np.isin(rows, held)
    if others is not None:
        for t in range(min(len(window) - 1, len(others))):  # read elsewhere before its use
            later = keep & (use > t)
            keep[later] &= ~np.isin(rows[later], others[t])
    rows, use = rows[keep], use[keep]
    nearest = np.lexsort((rows, use))[:budget]
    return np.sort(rows[nearest])


def cached_bytes(
    reads: list[list[np.ndarray]], placement, dim: int, lookahead: int, budget: int
) -> CacheBytes:
    """The bytes of `reads[s][r]` (rank r's ids at step s, one per lookup, as the
    all-to-all sends them) through each rank's oracle cache of `budget` rows (module doc).
    `placement`: anything with `server(rank, ids)` (a `Placement`, or `Keyed` for ids keyed
    across tables)."""
    steps, world = len(reads), len(reads[0])
    vector, row = 4 * dim, 4 * (dim + 1)
    fetch, lookup, write = ID_BYTES + row, ID_BYTES + 2 * vector, ID_BYTES + vector
    out = CacheBytes()
    # the rows each step reads, and how many ranks read each (a held copy goes stale when
    # another rank reads, so updates, its row)
    readers = [np.unique(np.concatenate(reads[s]), return_counts=True) for s in range(steps)]

    for rank in range(world):
        looked = []  # the remote lookups, each as sent (a row read twice is sent twice)
        for s in range(steps):
            ids = reads[s][rank]
            looked.append(ids[placement.server(rank, ids) != rank])
        remote = [np.unique(x) for x in looked]
        # the rows other ranks read at each step (what makes a held copy stale)
        elsewhere = []
        for s in range(steps):
            ids, n = readers[s]
            elsewhere.append(ids[n - np.isin(ids, reads[s][rank]) > 0])
        held, stale = np.zeros(0, np.int64), np.zeros(0, bool)
        for s in range(steps):
            want = plan(remote, s, lookahead, budget, elsewhere[s:], held[~stale])
            kept = held[np.isin(held, want) & ~stale]
            fetched = np.setdiff1d(want, kept, assume_unique=True)
            before = readers[s - 1][0] if s else np.zeros(0, np.int64)
            late = np.isin(fetched, before)  # updated at s-1: only after it, critical
            out.critical += fetch * float(late.sum())
            out.prefetched += fetch * float((~late).sum())
            hit = np.isin(looked[s], want)
            out.hits += int(hit.sum())
            out.remote += len(looked[s])
            out.critical += lookup * (len(looked[s]) - int(hit.sum()))
            out.uncached += lookup * len(looked[s])
            # the held rows read now: written through to their owners in the step
            wrote = np.intersect1d(remote[s], want, assume_unique=True)
            out.critical += write * float(len(wrote))
            held = want
            stale = np.isin(held, elsewhere[s])
    return out


class Keyed:
    """Tables' placements as one, for ids keyed across tables (`offsets[table] + row`)."""

    def __init__(self, placements: list[Placement], offsets: np.ndarray):
        self.placements, self.offsets = placements, offsets

    def server(self, rank: int, keys: np.ndarray) -> np.ndarray:
        table = np.searchsorted(self.offsets, keys, side="right") - 1
        out = np.empty(len(keys), np.int64)
        for t in np.unique(table):
            mine = table == t
            out[mine] = self.placements[t].server(rank, keys[mine] - self.offsets[t])
        return out
