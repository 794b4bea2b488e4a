import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from recd_core.warehouse import PartitionNotFound, Warehouse

DAY = "2026-11-01"


def _table(n, start=0):
    return pa.table({"x": pa.array(range(start, start + n), pa.int64())})


def _write(wh, table, **kw):
    with wh.writing("t", DAY, **kw) as w:
        w.write(table, max_rows_per_file=100)
    return w.info


def test_rewriting_a_partition_replaces_it(tmp_path):
    wh = Warehouse(tmp_path)
    info = _write(wh, _table(250))
    assert info.rows == 250 and len(info.files) == 3
    _write(wh, _table(250))
    _write(wh, _table(120, start=1000))
    t = wh.read("t", DAY)
    assert t["x"].to_pylist() == list(range(1000, 1120)), "no duplicates, no leftovers"
    part = tmp_path / "t" / f"ds={DAY}"
    names = sorted(p.name for p in part.iterdir())
    assert len(names) == 3 and names[0] == "_manifest.json"
    assert names[1].startswith("part-00000-") and names[2].startswith("part-00001-")
    assert wh.partitions("t") == [DAY]


def test_a_failure_mid_write_leaves_the_previous_partition(tmp_path):
    wh = Warehouse(tmp_path)
    _write(wh, _table(50))
    with pytest.raises(RuntimeError), wh.writing("t", DAY) as w:
        w.write(_table(300, start=500), max_rows_per_file=100)
        raise RuntimeError("stage crashed")
    assert wh.read("t", DAY)["x"].to_pylist() == list(range(50))
    assert not any((tmp_path / "t" / "_staging").iterdir()), "the staging files are removed"


def test_sigkill_mid_write_leaves_the_previous_partition(tmp_path):
    wh = Warehouse(tmp_path)
    _write(wh, _table(50))
    script = textwrap.dedent(
        f"""
        import os, signal
        import pyarrow as pa, pyarrow.parquet as pq
        from recd_core.warehouse import Warehouse
        calls = 0
        real = pq.ParquetWriter.write_table
        def dying(self, *a, **k):
            global calls
            calls += 1
            if calls == 2:  # after the first file is on disk, the process is killed
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, *a, **k)
        pq.ParquetWriter.write_table = dying
        wh = Warehouse({str(tmp_path)!r})
        with wh.writing("t", {DAY!r}) as w:
            w.write(pa.table({{"x": pa.array(range(500, 800), pa.int64())}}), max_rows_per_file=100)
        """
    )
    r = subprocess.run([sys.executable, "-c", script])
    assert r.returncode == -9
    assert any((tmp_path / "t" / "_staging").iterdir()), "the killed write left its staging files"
    assert Warehouse(tmp_path).read("t", DAY)["x"].to_pylist() == list(range(50))
    _write(wh, _table(10))  # the next write cleans up
    assert not any((tmp_path / "t" / "_staging").iterdir())
    assert wh.read("t", DAY).num_rows == 10


def test_a_crash_between_the_two_renames_is_recovered(tmp_path):
    wh = Warehouse(tmp_path)
    _write(wh, _table(50))
    live = tmp_path / "t" / f"ds={DAY}"
    trash = tmp_path / "t" / "_trash" / f"ds={DAY}-abc123"
    trash.parent.mkdir(parents=True)
    live.rename(trash)  # the swap moved the live partition away, then the process died
    assert Warehouse(tmp_path).read("t", DAY)["x"].to_pylist() == list(range(50))
    assert not trash.exists()


def test_partition_keys_and_missing_partitions(tmp_path):
    wh = Warehouse(tmp_path)
    _write(wh, _table(5), layout="clustered")
    assert (tmp_path / "t" / "layout=clustered" / f"ds={DAY}").is_dir()
    assert wh.read("t", DAY, layout="clustered").num_rows == 5
    with pytest.raises(PartitionNotFound, match="layout=shuffled"):
        wh.read("t", DAY, layout="shuffled")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        wh.partition_path("t", "yesterday")


def test_warehouse_uri_through_pyarrow_fs(tmp_path):
    wh = Warehouse(f"file://{tmp_path}/wh")
    _write(wh, _table(7))
    assert Warehouse(tmp_path / "wh").read("t", DAY).num_rows == 7


@pytest.fixture
def s3_uri():
    """A real S3 API (moto's server) on loopback; the warehouse talks to it through pyarrow."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = pafs.S3FileSystem(
        access_key="test",
        secret_key="test",
        endpoint_override=f"{host}:{port}",
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
    )
    s3.create_dir("recd-bucket")
    yield (
        f"s3://test:test@recd-bucket/wh?endpoint_override={host}:{port}&scheme=http&region=us-east-1",
        s3,
    )
    server.stop()


def test_object_store_warehouse_commits_by_manifest(s3_uri):
    uri, s3 = s3_uri
    wh = Warehouse(uri)
    assert not wh.renames_atomically
    import pyarrow.fs as pafs

    def left():
        infos = s3.get_file_info(pafs.FileSelector(f"recd-bucket/wh/t/ds={DAY}"))
        return sorted(i.base_name for i in infos)

    first = _write(wh, _table(250))
    second = _write(wh, _table(120, start=1000))
    assert wh.read("t", DAY)["x"].to_pylist() == list(range(1000, 1120))
    # the replaced version stays through one commit (a pinned reader may be reading it)
    assert left() == sorted(["_manifest.json", *first.files, *second.files])
    third = _write(wh, _table(50, start=2000))
    assert left() == sorted(["_manifest.json", *second.files, *third.files]), "older files go"
    second = third
    with pytest.raises(RuntimeError), wh.writing("t", DAY) as w:
        w.write(_table(300), max_rows_per_file=100)
        raise RuntimeError("crash before the commit")
    assert wh.read("t", DAY)["x"].to_pylist() == list(range(2000, 2050))


def _sessions_table(n):
    """Rows in runs of 1-4 with a per-run list value and key, and a per-row value."""
    import numpy as np

    run = np.repeat(np.arange(n), np.random.default_rng(0).integers(1, 5, n))[:n]
    return pa.table(
        {
            "x": pa.array(range(n), pa.int64()),
            "run": pa.array(run, pa.int64()),
            "user": pa.array([[int(r), int(r) * 2] for r in run], pa.list_(pa.int64())),
        }
    )


def _write_normalized(wh, table, rows_per_file=100, row_group=32):
    """Store `table` normalized on `run` (as generate does): `user` once per run of each row
    group, in the side file; the data file keeps `x`, `run` and the index."""
    import numpy as np
    import pyarrow.parquet as pq

    with wh.writing("t", DAY) as w:
        w.normalize(["user"], "_side_row", table.column_names)
        for f, lo in enumerate(range(0, table.num_rows, rows_per_file)):
            part = table.slice(lo, rows_per_file)
            name = f"part-{f:05d}-{w.write_id}.parquet"
            path, side_path = w.add_file(name, part.num_rows), w.add_side_file(name)
            with (
                pq.ParquetWriter(
                    path,
                    pa.schema([*part.schema][:2] + [pa.field("_side_row", pa.int32())]),
                    filesystem=wh.fs,
                ) as rows_w,
                pq.ParquetWriter(
                    side_path, pa.schema([part.schema.field("user")]), filesystem=wh.fs
                ) as side_w,
            ):
                for g in range(0, part.num_rows, row_group):
                    chunk = part.slice(g, row_group)
                    run = np.asarray(chunk["run"])
                    first = np.r_[True, run[1:] != run[:-1]]
                    index = pa.array(np.cumsum(first, dtype=np.int32) - 1)
                    rows_w.write_table(chunk.select(["x", "run"]).append_column("_side_row", index))
                    side_w.write_table(chunk.select(["user"]).filter(pa.array(first)))
    return w.info


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_normalized_partition_reads_back_whole_and_as_stored(tmp_path, store, request):
    wh = (
        Warehouse(tmp_path) if store == "local" else Warehouse(request.getfixturevalue("s3_uri")[0])
    )
    table = _sessions_table(250)
    _write_normalized(wh, _sessions_table(300))  # an older version, replaced
    info = _write_normalized(wh, table)
    assert info.rows == 250 and len(info.files) == 3
    assert wh.read("t", DAY).equals(table)
    assert wh.read_schema("t", DAY) == table.schema
    assert wh.read("t", DAY, columns=["user", "x"]).equals(table.select(["user", "x"]))
    assert wh.read_range("t", DAY, 20, 170).equals(table.slice(20, 150))  # files, row groups
    stored = wh.read_range_normalized("t", DAY, 20, 170)
    assert stored.rows.column_names == ["x", "run"]
    assert stored.side.num_rows < 150, "each run's value once (per row group)"
    expanded = stored.side.take(pa.array(stored.index))["user"]
    assert expanded.to_pylist() == table.slice(20, 150)["user"].to_pylist()
    assert wh.normalized_columns("t", DAY) == ["user"]
    if store == "s3":  # committed by manifest: the side files came along, the old ones went
        import pyarrow.fs as pafs

        s3 = request.getfixturevalue("s3_uri")[1]
        left = [
            i.base_name for i in s3.get_file_info(pafs.FileSelector(f"recd-bucket/wh/t/ds={DAY}"))
        ]
        # this version (3 files, 3 sides, the manifest) and the one it replaced (kept through
        # one commit, for a reader that pinned it)
        assert len(left) == 13 and sum(n.startswith("_side-") for n in left) == 6
        assert all(n in left for n in info.files)


def test_a_partition_stored_whole_reads_as_its_own_runs(tmp_path):
    wh = Warehouse(tmp_path)
    _write(wh, _table(250))
    stored = wh.read_range_normalized("t", DAY, 10, 230)
    assert stored.rows.equals(_table(220, start=10)) and stored.side.num_columns == 0
    assert wh.normalized_columns("t", DAY) == []
