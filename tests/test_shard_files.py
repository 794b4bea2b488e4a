"""A model saved as shard files (no process holding a whole table): readers score it as the
single-file model, its damage is named in one line, a warm start reads it onto any number of
processes (saved by 2, loaded by 3 and by 1: the same scores)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import DAY, NEXT, SMALL_MODEL

from recd_core.config import PreprocessConfig, TrainConfig
from recd_core.dpp.preprocess import preprocess
from recd_core.errors import BadInput
from recd_core.modeling.mapped_model import MappedDLRM
from recd_core.modeling.saved import load_model, predict, read_optimizer
from recd_core.modeling.shard_files import materialized, open_tables
from recd_core.modeling.train import train
from recd_core.modeling.warm_start import initial_state

BASE = dict(batch_size=256, model=SMALL_MODEL, threads=1, cooccurrence_weight=0.0, max_steps=6)


def _trained(wh, **over) -> dict:
    preprocess(wh, DAY, PreprocessConfig(batch_size=256))
    return train(wh, DAY, TrainConfig(**BASE, **over), nproc=over.pop("nproc", 1))


def _scores(wh, uri: str) -> np.ndarray:
    model, meta = load_model(uri)
    return predict(model, meta, wh.read("samples", NEXT, layout="clustered").slice(0, 2000))


def test_a_model_saved_as_shards_scores_as_its_single_file_twin(fresh_warehouse):
    one = _trained(fresh_warehouse)
    shards = _trained(fresh_warehouse, saved_layout="shards")
    assert shards["train.saved_layout"] == "shards" and one["train.saved_layout"] == "single"
    model, meta = load_model(shards["train.model_uri"])
    assert isinstance(model, MappedDLRM)
    base = Path(shards["train.model_uri"])
    files = sorted((base / "tables").iterdir())
    assert files and not any(k.startswith("bags.") for k in torch.load(base / "model.pt"))
    # the single-file model of the same run: its tables are the shard files' contents
    single, _ = load_model(one["train.model_uri"])
    tables = open_tables(base, meta)
    for key, t in tables.items():
        np.testing.assert_array_equal(t.materialize().numpy(), single.state_dict()[key].numpy())
    np.testing.assert_allclose(
        _scores(fresh_warehouse, shards["train.model_uri"]),
        _scores(fresh_warehouse, one["train.model_uri"]),
        atol=1e-6,
    )
    # the accumulators the warm start continues are the single-file model's
    init = initial_state(shards["train.model_uri"], model.features, TrainConfig(**BASE))
    theirs = read_optimizer(one["train.model_uri"])["sparse"]["state"]
    mine = materialized(init.optimizer)["sparse"]["state"]
    for i, state in theirs.items():
        np.testing.assert_array_equal(mine[i]["sum"].numpy(), state["sum"].numpy())


def test_a_damaged_shard_file_is_named_in_one_line(fresh_warehouse):
    s = _trained(fresh_warehouse, saved_layout="shards")
    meta = json.loads(Path(s["train.model_uri"], "model.json").read_text())
    first = next(iter(meta["tables"]["tables"].values()))["shards"][0]["weights"]
    path = Path(s["train.model_uri"], first)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(BadInput) as e:
        load_model(s["train.model_uri"])
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    path.unlink()
    with pytest.raises(BadInput, match="shard file is missing"):
        load_model(s["train.model_uri"])


def _placed_and_saved_again(rank: int, world: int, port: str, uri: str, run: str) -> None:
    """One rank of a run of `world` processes that places the saved model `uri` (a warm
    start: its tables' rows read from its shard files, cut for this placement) and saves it
    again as shard files, its own, as model `run` of the same warehouse."""
    import os

    import torch.distributed as dist

    from recd_core.config import FeatureSet
    from recd_core.modeling.saved import save_model
    from recd_core.modeling.sharded.strategy import Sharded
    from recd_core.modeling.warm_start import continue_optimizers
    from recd_core.warehouse import Warehouse

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    wh = Warehouse(uri.rsplit("/models/", 1)[0])
    meta = json.loads(Path(uri, "model.json").read_text())
    features = FeatureSet.model_validate(meta["features"])
    cfg = TrainConfig(**BASE, sharding="row_wise", saved_layout="shards")
    init = initial_state(uri, features, cfg)
    parallel = Sharded(rank, world, torch.device("cpu"))
    model, net, init = parallel.build(features, cfg, init, 0.5)
    model.calibration.copy_(init.state["calibration"])  # a warm start refits it; kept here
    opt_dense, opt_sparse = parallel.optimizers(model, cfg, warm=True)
    continue_optimizers(opt_dense, opt_sparse, init.optimizer)
    optimizer = {"dense": opt_dense.state_dict(), "sparse": opt_sparse.state_dict()}
    saved = parallel.saved_state(
        model, net, optimizer, opt_sparse, cfg, wh.fs, f"{wh.root}/models/{run}"
    )
    if rank == 0:
        save_model(
            wh,
            run,
            model,
            cfg,
            meta["prepared"],
            {},
            saved.optimizer,
            saved.state,
            None,
            saved.tables,
        )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_saved_by_two_processes_loaded_by_three_and_by_one_scores_alike(fresh_warehouse):
    """TorchRec cannot reshard a checkpoint to another world size (its issue 2534); recd's
    shard files are cut again by whoever loads them."""
    import torch.multiprocessing as mp

    from recd_core.modeling.launch import free_port
    from recd_core.modeling.parallel import Replicated

    two = _trained(fresh_warehouse, sharding="row_wise", saved_layout="shards", nproc=2)
    assert two["train.saved_layout"] == "shards" and two["train.world_size"] == 2
    uri = two["train.model_uri"]
    meta = json.loads(Path(uri, "model.json").read_text())
    rows = {k: [e["box"][2] for e in t["shards"]] for k, t in meta["tables"]["tables"].items()}
    assert all(len(r) == 2 for r in rows.values()), rows  # each table in 2 row ranges
    three = f"{fresh_warehouse.uri}/models/resharded-3"
    mp.start_processes(
        _placed_and_saved_again,
        args=(3, str(free_port()), uri, "resharded-3"),
        nprocs=3,
        start_method="spawn",
    )
    meta3 = json.loads(Path(three, "model.json").read_text())
    assert all(len(t["shards"]) == 3 for t in meta3["tables"]["tables"].values())
    expected = _scores(fresh_warehouse, uri)
    np.testing.assert_allclose(_scores(fresh_warehouse, three), expected, atol=1e-5)
    # by one process that holds the tables: the shards read whole (a replicated warm start)
    features = load_model(three)[0].features
    cfg = TrainConfig(**BASE)
    init = initial_state(three, features, cfg)
    one, _, init = Replicated(0, 1, torch.device("cpu")).build(features, cfg, init, 0.5)
    one.calibration.copy_(init.state["calibration"])
    _, meta1 = load_model(three)
    table = fresh_warehouse.read("samples", NEXT, layout="clustered").slice(0, 2000)
    np.testing.assert_allclose(predict(one.eval(), meta1, table), expected, atol=1e-5)
    saved2, saved3 = read_optimizer(uri), read_optimizer(three)  # the dense optimizer kept
    assert saved2["dense"]["state"].keys() == saved3["dense"]["state"].keys()
    acc2 = materialized(initial_state(uri, features, cfg).optimizer["sparse"])
    acc3 = materialized(initial_state(three, features, cfg).optimizer["sparse"])
    for i in acc2["state"]:  # the tables' accumulators, cut for 3 and back
        np.testing.assert_allclose(acc3["state"][i]["sum"], acc2["state"][i]["sum"], rtol=1e-6)


def test_shard_files_give_back_any_box_and_any_rows_of_a_table_cut_both_ways(tmp_path):
    """A table cut into row and column ranges (row-, column- and table-wise placements all
    come to this) reads back whole, as any box and as any rows, from the files alone."""
    import pyarrow.fs as pafs

    from recd_core.modeling.shard_files import LazyAccumulator, layout, write_shard
    from recd_core.modeling.tables import TableSpec

    table = torch.randn(1000, 8)
    acc = torch.rand(1000)
    boxes = [(0, 0, 600, 5), (0, 5, 600, 3), (600, 0, 400, 8)]
    fs, base = pafs.LocalFileSystem(), str(tmp_path)
    entries = [
        (
            "t.weight",
            write_shard(
                fs,
                base,
                "t",
                box,
                table[box[0] : box[0] + box[2], box[1] : box[1] + box[3]],
                acc[box[0] : box[0] + box[2]],
            ),
        )
        for box in boxes
    ]
    meta = {"tables": layout(8, 3, [TableSpec("t", 1000, ("f",), "t.weight", 0.05)], entries)}
    (lazy,) = open_tables(tmp_path, meta).values()
    assert torch.equal(lazy.materialize(), table)
    assert torch.equal(lazy[550:650, 2:7], table[550:650, 2:7])  # across every cut
    ids = torch.tensor([999, 0, 599, 600, 3, 3])
    assert torch.equal(lazy.rows(ids), table[ids])
    # a row's accumulator: its column shards' weighted by their widths (here all equal)
    assert torch.allclose(LazyAccumulator(lazy)[:], acc)
    with pytest.raises(RuntimeError, match="cover"):
        layout(8, 3, [TableSpec("t", 1000, ("f",), "t.weight", 0.05)], entries[:2])
