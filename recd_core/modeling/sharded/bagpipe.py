"""BagPipe's oracle cacher (Agarwal et al., 2023) on recd's batches: DPP writes a day's batches
before training starts, so the rows every step will read are known; each rank keeps, within a
cache budget, the remote rows its next `lookahead` steps read, fetched ahead of use where the
row's last update allows, so the step's lookups of them are local.

The cache a rank holds while step s runs (`plan`), Belady within the lookahead: of the
remote rows it reads in steps s .. s+k-1, the `budget` with the nearest next use (a row read
at s first); a row read beyond the lookahead is never held, a held row whose next use falls
out of the budget is evicted. Exact (as synchronous as the uncached run, BagPipe's
guarantee), so a cached copy is never read stale:

    a row entering the cache      its weights and accumulator are fetched (4 (d + 1) bytes):
                                  during step s-1, overlapped, unless a rank updates the row
                                  at s-1; then after it, on step s's critical path
    a held row another rank       its copy takes the update (4 d bytes, the other ranks'
      updates at step u           gradient): before step u+1's lookups (critical) if the
                                  rank reads it at u+1, else overlapped with u+1
    a held row the rank reads     its gradient also goes to the row's owner (write-through,
                                  4 d bytes), so other ranks read the owner's copy fresh:
                                  critical if another rank reads it at the next step
    a remote row not held         the uncached lookup: its id, its vector, its gradient
                                  (8 + 8 d bytes), on the critical path

A rank updates a held row it alone read locally (it holds the accumulator). Rows are those
remote under a placement (row-wise, or FlexShard's: the cache then covers what it did not
copy). `replay` sums the bytes over ranks and steps: the critical path's, the prefetched
(overlapped) ones, and the hit rate, beside the uncached critical path of the same lookups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recd_core.modeling.sharded.flexshard import ID_BYTES, Placement


@dataclass
class CacheBytes:
    """One table's bytes over the replayed steps, summed over ranks."""

    critical: float = 0.0  # on the steps' critical path, with the cache
    prefetched: float = 0.0  # fetched or refreshed overlapped with a step
    uncached: float = 0.0  # the critical path without a cache (every remote read)
    hits: int = 0
    remote: int = 0  # remote reads in all

    def add(self, other: CacheBytes) -> None:
        for f in ("critical", "prefetched", "uncached", "hits", "remote"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


def plan(remote: list[np.ndarray], s: int, lookahead: int, budget: int) -> np.ndarray:
    """The rows held while step s runs: of the rows in `remote[s .. s+k-1]` (one rank's
    remote reads a step, unique), the `budget` with the nearest next use, ties by id."""
    seen: dict[int, int] = {}
    rows, first = [], []
    for j in range(s, min(s + lookahead, len(remote))):
        new = np.setdiff1d(remote[j], np.fromiter(seen, np.int64, len(seen)), assume_unique=True)
        seen.update(dict.fromkeys(new.tolist(), j))
        rows.append(new)
        first.append(np.full(len(new), j))
    if not rows:
        return np.zeros(0, np.int64)
    rows_a, first_a = np.concatenate(rows), np.concatenate(first)
    order = np.lexsort((rows_a, first_a))[:budget]
    return np.sort(rows_a[order])


def cached_bytes(
    reads: list[list[np.ndarray]], placement: Placement, dim: int, lookahead: int, budget: int
) -> CacheBytes:
    """The bytes of `reads[s][r]` (rank r's unique ids of one table at step s) through each
    rank's oracle cache of `budget` rows (module doc)."""
    steps, world = len(reads), len(reads[0])
    vector, row = 4 * dim, 4 * (dim + 1)
    out = CacheBytes()
    # how many ranks read each row at each step (a row read by others: its copies go stale)
    readers = []
    for s in range(steps):
        ids, n = np.unique(np.concatenate(reads[s]), return_counts=True)
        readers.append((ids, n))

    def read_by_others(s: int, rank_ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Whether a rank other than the one reading `rank_ids` at step s reads each row."""
        if s < 0 or s >= steps or not len(rows):
            return np.zeros(len(rows), bool)
        ids, n = readers[s]
        at = np.searchsorted(ids, rows).clip(max=max(len(ids) - 1, 0))
        count = np.where(len(ids) and ids[at] == rows, n[at], 0) if len(ids) else 0 * rows
        mine = np.isin(rows, rank_ids, assume_unique=False)
        return count - mine > 0

    def read_at(s: int, rows: np.ndarray) -> np.ndarray:
        if s < 0 or s >= steps or not len(rows):
            return np.zeros(len(rows), bool)
        return np.isin(rows, readers[s][0])

    for rank in range(world):
        looked = []  # the remote lookups, each as sent (a row read twice is sent twice)
        for s in range(steps):
            ids = reads[s][rank]
            looked.append(ids[placement.server(rank, ids) != rank])
        remote = [np.unique(x) for x in looked]
        held = np.zeros(0, np.int64)
        for s in range(steps):
            now = plan(remote, s, lookahead, budget)
            prev = reads[s - 1][rank] if s else np.zeros(0, np.int64)
            entering = np.setdiff1d(now, held, assume_unique=True)
            staying = np.intersect1d(now, held, assume_unique=True)
            # entering rows: fetched overlapped unless updated at s-1
            late = read_at(s - 1, entering)
            out.critical += row * float(late.sum())
            out.prefetched += row * float((~late).sum())
            # staying rows another rank updated at s-1: refreshed, critical if read now
            stale = read_by_others(s - 1, prev, staying)
            used = np.isin(staying, remote[s])
            out.critical += vector * float((stale & used).sum())
            out.prefetched += vector * float((stale & ~used).sum())
            hit = np.isin(looked[s], now)
            out.hits += int(hit.sum())
            out.remote += len(looked[s])
            miss = len(looked[s]) - int(hit.sum())
            out.critical += (ID_BYTES + 2 * vector) * miss
            out.uncached += (ID_BYTES + 2 * vector) * len(looked[s])
            # write-through of the held rows read now: critical if another rank reads next
            hits = np.intersect1d(remote[s], now, assume_unique=True)
            nxt = reads[s + 1][rank] if s + 1 < steps else np.zeros(0, np.int64)
            soon = read_by_others(s + 1, nxt, hits)
            out.critical += vector * float(soon.sum())
            out.prefetched += vector * float((~soon).sum())
            held = now
    return out
