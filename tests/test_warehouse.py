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
        access_key="test", secret_key="test", endpoint_override=f"{host}:{port}",
        scheme="http", region="us-east-1", allow_bucket_creation=True,
    )  # fmt: skip
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
    _write(wh, _table(250))
    _write(wh, _table(120, start=1000))
    assert wh.read("t", DAY)["x"].to_pylist() == list(range(1000, 1120))
    import pyarrow.fs as pafs

    left = [i.base_name for i in s3.get_file_info(pafs.FileSelector(f"recd-bucket/wh/t/ds={DAY}"))]
    assert sorted(left)[0] == "_manifest.json" and len(left) == 3, "old files are gone"
    with pytest.raises(RuntimeError), wh.writing("t", DAY) as w:
        w.write(_table(300), max_rows_per_file=100)
        raise RuntimeError("crash before the commit")
    assert wh.read("t", DAY)["x"].to_pylist() == list(range(1000, 1120))
