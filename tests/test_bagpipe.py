"""BagPipe's oracle cacher (modeling/sharded/bagpipe.py): what it holds within its lookahead
and budget, what a step then sends on its critical path and overlapped, and its replay on a
day's lookups (bench/bagpipe.py) against the uncached run's bytes."""

from __future__ import annotations

import numpy as np
import pytest
from test_flexshard_training import _gaps, beside_row_wise
from test_train import DAY

from recd_core.bench.bagpipe import markdown, replay, run
from recd_core.bench.flexshard import counts, list_tables, lookups
from recd_core.config import PreprocessConfig
from recd_core.dpp.batch_store import BatchStore
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling.sharded.bagpipe import cached_bytes, plan
from recd_core.modeling.sharded.flexshard import ID_BYTES, row_wise, traffic

DIM = 4
VECTOR, ROW = 4 * DIM, 4 * (DIM + 1)
NONE = np.zeros(0, np.int64)


def test_the_cache_holds_the_nearest_next_uses_within_lookahead_and_budget():
    remote = [np.array([5, 9]), np.array([7]), np.array([3, 9]), np.array([1])]
    assert plan(remote, 0, 1, 10).tolist() == [5, 9]  # a row is fetched for its step
    assert plan(remote, 0, 3, 10).tolist() == [5, 9]  # not earlier
    held = np.array([3, 7])  # read again within the lookahead: they stay
    assert plan(remote, 0, 3, 10, held=held).tolist() == [3, 5, 7, 9]
    assert plan(remote, 0, 1, 10, held=held).tolist() == [5, 9]  # beyond it: evicted
    assert plan(remote, 0, 3, 3, held=held).tolist() == [5, 7, 9]  # full: the farthest goes
    assert plan(remote, 2, 8, 10, held=np.array([1])).tolist() == [1, 3, 9]
    # a row another rank reads before this one's next use would be stale by then: let go
    others = [np.array([7]), NONE, NONE, NONE]
    assert plan(remote, 0, 3, 10, others, held).tolist() == [3, 5, 9]
    assert plan(remote, 1, 3, 10, others[1:], np.array([1, 3, 9])).tolist() == [1, 3, 7, 9]


def test_a_row_one_rank_reads_is_fetched_ahead_and_read_locally():
    """Rank 0 reads row 2 (held by rank 1) three steps running, nobody else does: one fetch,
    overlapped, then local reads; on the critical path only the gradient written through."""
    reads = [[np.array([2]), NONE] for _ in range(3)]
    got = cached_bytes(reads, row_wise(4, 2, 2), DIM, lookahead=2, budget=1)
    assert got.uncached == 3 * (ID_BYTES + 2 * VECTOR)
    assert got.hits == got.remote == 3
    assert got.prefetched == ID_BYTES + ROW  # the fetch, during the step before
    assert got.critical == 3 * (ID_BYTES + VECTOR)  # each step's write-through


def test_a_row_another_rank_updates_is_fetched_again_on_the_critical_path():
    """Rank 1 (the owner) also reads row 2 every step: rank 0's copy goes stale each step,
    so it is fetched again after the update (critical), and its gradient is written through
    each step; with no budget every read is a remote lookup."""
    reads = [[np.array([2]), np.array([2])] for _ in range(3)]
    got = cached_bytes(reads, row_wise(4, 2, 2), DIM, lookahead=2, budget=1)
    assert got.critical == 2 * (ID_BYTES + ROW) + 3 * (ID_BYTES + VECTOR)
    assert got.prefetched == ID_BYTES + ROW  # the first fetch: nothing updated it before
    uncached = cached_bytes(reads, row_wise(4, 2, 2), DIM, lookahead=2, budget=0)
    assert uncached.critical == uncached.uncached == 3 * (ID_BYTES + 2 * VECTOR)
    assert uncached.hits == 0


@pytest.mark.slow
def test_on_a_days_lookups_the_cache_cuts_the_critical_path_more_with_more_budget(fresh_warehouse):
    for mode in ("dedup", "baseline"):
        preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=512, mode=mode))
    store = BatchStore(fresh_warehouse, DAY, "dedup")
    tables = list_tables(store.model_features)
    seen = counts(store, tables)
    small = replay(store, tables, seen, 32, 4, 6, 2, 0.002)["row_wise"]
    large = replay(store, tables, seen, 32, 4, 6, 2, 1.0)["row_wise"]
    assert small.uncached == large.uncached > large.critical
    assert small.critical > large.critical and small.hits < large.hits <= large.remote
    # without a cache the critical path is what the sharded lookups send (the traffic model)
    parts = [lookups(store[s].part(r, 4), tables) for s in range(6) for r in range(4)]
    sent = sum(
        traffic(row_wise(rows, 4, 4), [parts[s * 4 + r][t] for r in range(4)], 32).total
        for t, (_, rows) in tables.items()
        for s in range(6)
    )
    assert large.uncached == pytest.approx(sent / 6)
    figures = run(fresh_warehouse, DAY, steps=3)
    assert "| dedup | 64 | flexshard |" in markdown(figures)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "background"), [("dedup", True), ("baseline", False)])
def test_training_with_the_cache_ends_where_the_row_wise_plan_ends(
    fresh_warehouse, mode, background
):
    """50 steps on 2 processes from one start: FlexShard's tables with each rank's oracle
    cache (lookahead 4, 2x row-wise's rows: most remote reads served from the cache; its
    rows fetched in the background while the step before computes, or at the step's start)
    end where TorchRec's row-wise plan ends."""
    cache = {
        "budget": 1.0,
        "cache_lookahead": 4,
        "cache_budget": 2.0,
        "cache_background": background,
    }
    rows, got = beside_row_wise(
        fresh_warehouse, {"sharding": "flexshard", "flexshard": cache}, mode
    )
    assert got["train.steps"] == rows["train.steps"] == 50
    assert got["train.cache_hit_rate"] > 0.5  # most remote reads served from the cache
    sent = got["train.flexshard_bytes"]
    assert sent["fetch_rows"] > 0 and sent["write_through"] > 0
    # in the background, most rows come while the step before computes
    assert (sent.get("prefetch_rows", 0) > sent["fetch_rows"]) == background
    print(mode, got["train.cache_hit_rate"], sent)
    gaps = _gaps(rows["train.model_uri"], got["train.model_uri"])
    print(mode, {k: f"{v:.1e}" for k, v in gaps.items()})
    assert gaps["model"] < 1e-6 and gaps["tables"] < 1e-6 and gaps["accumulators"] < 1e-6
