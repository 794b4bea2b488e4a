"""FlexShard's placement (modeling/sharded/flexshard.py): every row served by exactly one
rank wherever it is looked up, no rank past the memory budget, the hottest rows replicated
first, a one-line refusal when the budget cannot hold the table; and the traffic model's
bytes, checked by hand on small cases and against a day's real lookups (bench/flexshard.py)."""

from __future__ import annotations

import numpy as np
import pytest

from recd_core.bench.flexshard import counts, list_tables, lookups, replay
from recd_core.bench.flexshard_steps import cache_markdown, measured
from recd_core.bench.flexshard_steps import markdown as steps_markdown
from recd_core.config import PreprocessConfig
from recd_core.dpp.batch_store import BatchStore
from recd_core.dpp.preprocess import preprocess
from recd_core.modeling.sharded.flexshard import (
    COLD,
    HOT,
    ID_BYTES,
    WARM,
    RowBudgetRefused,
    flexshard,
    row_wise,
    table_wise,
    traffic,
)
from recd_core.modeling.sharded.flexshard_tables import id_features, keys_of_parts

DAY = "2026-11-01"


def zipf_counts(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, rows + 1) ** 1.1
    return np.bincount(rng.choice(rows, 50_000, p=p / p.sum()), minlength=rows)


@pytest.mark.parametrize(("world", "per_node"), [(2, 2), (4, 4), (16, 8), (64, 8)])
def test_every_row_has_one_server_and_no_rank_passes_the_budget(world, per_node):
    rows = 5_000
    counts = zipf_counts(rows)
    floor = -(-rows // world)
    for budget in (floor, int(floor * 1.25), floor * 3):
        placed = flexshard(counts, world, per_node, budget)
        assert int(placed.rows_per_rank().max()) <= budget
        every = np.arange(rows)
        for rank in range(world):  # wherever a row is looked up, one rank serves it
            server = placed.server(rank, every)
            assert ((server >= 0) & (server < world)).all()
            hot = placed.tier == HOT
            assert (server[hot] == rank).all()  # a replica is local
            warm = placed.tier == WARM  # a node's copy, on the asking rank's node
            assert (server[warm] // per_node == rank // per_node).all()
        # the copies go to the hottest rows: no copied row colder than an uncopied one
        copied = placed.tier != COLD
        if copied.any() and (~copied).any():
            assert counts[copied].min() >= counts[~copied].max()
        if budget == floor:
            assert not copied.any()  # no slack: row by row, like the plan it replaces


def test_a_budget_that_cannot_hold_the_table_is_refused_in_one_line():
    with pytest.raises(RowBudgetRefused) as e:
        flexshard(zipf_counts(1_000), 4, 4, 200)
    assert "\n" not in str(e.value) and "row-wise needs 250" in str(e.value)


def test_the_traffic_model_counts_what_crosses_ranks_and_nodes():
    dim = 4
    vector = 2 * 4 * dim  # forward and backward
    # two ranks, rows 0-9 on rank 0 and 10-19 on rank 1 (row-wise)
    rw = row_wise(20, 2, 2)
    got = traffic(rw, [np.array([1, 2, 15]), np.array([3, 16, 16])], dim)
    assert got.ids == 2 * ID_BYTES and got.vectors == 2 * vector and got.cross == 0
    # the same table on rank 1 alone: rank 0's three lookups cross, none of rank 1's
    tw = table_wise(20, 2, 2, 1)
    assert traffic(tw, [np.array([1, 2, 15]), np.array([3, 16, 16])], dim).ids == 3 * ID_BYTES
    # 4 ranks on 2 nodes: a lookup from rank 0 of a row on rank 3 crosses nodes
    far = row_wise(40, 4, 2)
    got = traffic(far, [np.array([35]), np.array([]), np.array([]), np.array([])], dim)
    assert got.cross == ID_BYTES + vector == got.total
    # a hot row: local lookups, its gradient combined over all ranks (a ring: 2(w - 1) rows)
    counts = np.zeros(40, np.int64)
    counts[7] = 100
    hot = flexshard(counts, 4, 4, 11)  # slack 1 row a rank: one row on every rank
    assert hot.tier[7] == HOT
    got = traffic(hot, [np.array([7])] * 4, dim)
    assert got.ids == got.vectors == 0 and got.sync == 2 * 3 * 4 * dim


def test_on_a_days_lookups_flexshard_cuts_the_traffic_within_its_budget(fresh_warehouse):
    """The replay on the test day's batches: FlexShard with a quarter more rows a rank than
    row-wise sends fewer bytes on one node, and fewer across nodes on several; row-wise's
    bytes do not depend on the counts (its blocks are fixed)."""
    preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=512))
    store = BatchStore(fresh_warehouse, DAY, "dedup")
    tables = list_tables(store.model_features)
    assert tables  # the history and the id lists
    seen = counts(store, tables)
    one_node = replay(store, tables, seen, 32, 4, 1.25, 4)
    assert one_node["flexshard"][0].total < one_node["row_wise"][0].total
    assert one_node["flexshard"][1] <= int(1.25 * one_node["row_wise"][1]) + len(tables)
    nodes = replay(store, tables, seen, 32, 16, 1.25, 4)
    assert nodes["flexshard"][0].cross < nodes["row_wise"][0].cross
    # the ranks' parts look up every row the whole batch does; a user row whose samples
    # fall in two parts is looked up by both (each rank deduplicates its own slice)
    whole = lookups(store[0], tables)
    parts = [lookups(store[0].part(r, 4), tables) for r in range(4)]
    for t in tables:
        split = np.concatenate([p[t] for p in parts])
        assert set(split.tolist()) == set(whole[t].tolist()) and len(split) >= len(whole[t])
    # BagPipe's oracle reads every rank's rows off the whole batch: the slices' own
    names = sorted({n for n, _ in id_features(store[0])})
    table_of, offsets = {n: i for i, n in enumerate(names)}, np.arange(len(names)) << 40

    def keyed(batch):  # the ids a slice's lookups send, each as often
        return sorted(int(offsets[table_of[n]] + i) for n, ids in id_features(batch) for i in ids)

    for world in (2, 3):
        got = keys_of_parts(store[1], world, offsets, table_of)
        assert [sorted(g.tolist()) for g in got] == [
            keyed(store[1].part(r, world)) for r in range(world)
        ]


@pytest.mark.slow
def test_measured_steps_match_the_traffic_model_and_flexshard_sends_the_least(fresh_warehouse):
    """Two processes train each plan a few steps on the day's batches: the bytes the
    all-to-alls (and FlexShard's sync) send are what the models (traffic, cache) predict
    for the same lookups, within 10%; FlexShard sends fewer than row-wise in both arms and
    holds no more than its budget (1.25x row-wise's rows, plus the tiers' rounding); its
    cache sends fewer still, part of it in the background while the step before computes
    (or all of it at the step's start, the same rows)."""
    for mode in ("dedup", "baseline"):
        preprocess(fresh_warehouse, DAY, PreprocessConfig(batch_size=512, mode=mode))
    variants = ("k4_b25", "k4_b25_at_step")
    got = measured(fresh_warehouse.uri, DAY, worlds=(2,), steps=2, cached=variants)
    for mode in ("dedup", "baseline"):
        key = f"sharded.flexshard.steps.{mode}.w2"
        cached = [f"sharded.bagpipe.steps.{mode}.w2.{v}" for v in variants]
        for k in [f"{key}.{plan}" for plan in ("table_wise", "row_wise", "flexshard")] + cached:
            assert got[f"{k}.bytes"] == pytest.approx(got[f"{k}.predicted_bytes"], rel=0.1)
            assert got[f"{k}.step_ms"] > 0
        assert got[f"{key}.flexshard.bytes"] < got[f"{key}.row_wise.bytes"]
        background, at_step = cached
        for k in cached:  # the cache serves most remote reads: fewer bytes still
            assert got[f"{k}.bytes"] < got[f"{key}.flexshard.bytes"]
            assert got[f"{k}.hit_rate"] > 0.5
        assert 0 < got[f"{background}.prefetched_bytes"] < got[f"{background}.bytes"]
        assert got[f"{background}.on_step_bytes"] < got[f"{at_step}.on_step_bytes"]
        assert got[f"{at_step}.prefetched_bytes"] == 0
        assert got[f"{background}.bytes"] == pytest.approx(got[f"{at_step}.bytes"], rel=0.01)
        # where a FlexShard step's time goes: its parts within the step
        parts = sum(got[f"{background}.{p}_ms"] for p in ("prepare", "lookup", "backward"))
        assert 0 < parts < got[f"{background}.step_mean_ms"]
        assert got[f"{background}.oracle_ms"] > 0 and got[f"{at_step}.prefetch_ms"] == 0
        assert got[f"{key}.flexshard.sync_bytes"] > 0 == got[f"{key}.row_wise.sync_bytes"]
        held, rows = got[f"{key}.flexshard.table_bytes_max"], got[f"{key}.row_wise.table_bytes_max"]
        assert rows <= held <= 1.3 * rows
    assert "| dedup | 2 | flexshard |" in steps_markdown(got)
    assert "| dedup | 2 | k4_b25_at_step |" in cache_markdown(got)
