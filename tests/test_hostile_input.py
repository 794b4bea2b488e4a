"""Hostile input, given as a new user (and an unlucky operator) would: every kind of bad line,
bad file, bad argument, bad model and bad store we know of, through the real `recd` command.

Each case checks the error contract (docs/architecture.md): no traceback; the documented exit
code; a refusal is one line on stderr; for ingestion, `rows_in` equals the lines (rows) in the
files, every bad line is quarantined with its reason and exact bytes, every clean line is
published. Two writers of one day: `test_concurrency.py`.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from event_lines import clean_lines, mutate
from recd_cli import ingest_day, recd

from recd_core.config_files import load_feature_set
from recd_core.warehouse import Warehouse

DAY = "2026-11-01"
DEEP = 10_000


def damaged_cases(clean: list[bytes]):
    """(damaged line, expected field or None, expected reason substring) for every kind of bad
    line, and the clean lines not used up."""
    c = iter(clean)
    deep_array = b"[" * DEEP + b"]" * DEEP
    deep_in_field = b'{"event_id": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}"
    # fmt: off
    return [
        (next(c)[:57], None, "invalid JSON"),  # truncated mid-line
        (next(c).replace(b'"user_id"', b'"user_\xff\xfeid"'), None, "invalid UTF-8"),
        (mutate(next(c), user_id="12"), "user_id", "expected an integer"),
        (mutate(next(c), label=True), "label", "expected an integer"),
        (mutate(next(c), item_dense=[1.0, "x", 2.0, 3.0]), "item_dense", "expected a number"),
        (mutate(next(c), user_friends=[1, 2.5]), "user_friends", "expected an integer"),
        (mutate(next(c), user_id=-5), "user_id", "negative id -5"),
        (mutate(next(c), item_tags=[3, -1]), "item_tags", "negative id in list"),
        (mutate(next(c), user_dense=[float("nan")] * 16), "user_dense", "not finite"),
        (mutate(next(c), item_dense=[1.0, float("inf"), 0, 0]), "item_dense", "not finite"),
        (mutate(next(c), item_dense=[7.25, 0, 0, 0]).replace(b"7.25", b"1e999"), "item_dense",
         "number too large"),
        (mutate(next(c), label=2), "label", "must be 0 or 1, got 2"),
        (mutate(next(c), ts=-1), "ts", "negative value -1"),
        (mutate(next(c), item_id=KeyError), "item_id", "missing required field 'item_id'"),
        (mutate(next(c), session_id=None), "session_id", "missing required field"),
        (mutate(next(c), user_history=list(range(129))), "user_history",
         "length 129 exceeds max_length 128"),
        (mutate(next(c), item_tags=[1, None]), "item_tags", "null list element"),
        (mutate(next(c), item_dense=[1.0, 2.0]), "item_dense", "expected 4 values, got 2"),
        (mutate(next(c), user_id=2**70), "user_id", "out of range"),
        (mutate(next(c), item_tags={"a": 1}), "item_tags", "expected a list"),
        (b"[1, 2, 3]", None, "not a JSON object"),
        (b"null", None, "not a JSON object"),
        (b'"just a string"', None, "not a JSON object"),
        (next(c) + next(c), None, "more than one JSON value"),
        (next(c).replace(b'{"event_id"', b'{"label":0,"event_id"'), "label", "appears twice"),
        (b"", None, "empty line"),
        (b"   \t ", None, "empty line"),
        (deep_array, None, "nested too deeply"),  # was a RecursionError for the whole day
        (deep_in_field, None, "nested too deeply"),
        (next(c)[:-1] + b', "note": "\\ud800"}', None, "surrogate"),  # a lone UTF-16 half
        (next(c)[:-1] + b', "note": "a\x00b"}', None, "control character"),
        (b"\x00\x01\x02" * 300_000, None, "invalid"),  # a megabyte of binary noise
    ], list(c)
    # fmt: on


def _write_json(path: Path, lines: list[bytes], gz: bool = False, bom: bool = False) -> None:
    data = (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if gz else data)


def test_every_kind_of_bad_line_is_quarantined_and_every_clean_line_published(day_logs, tmp_path):
    """One day's source holding every bad-line kind, in files of every awkward kind."""
    all_lines = clean_lines(day_logs)
    cases, clean = damaged_cases(all_lines[:600])
    src = tmp_path / "src"
    src.mkdir()
    expected: dict[tuple[str, int], tuple[bytes, str | None, str]] = {}
    published: list[bytes] = []

    # a.jsonl.gz: clean lines with a bad one after each; a redelivery; a session whose
    # user-side value changes mid-way
    out: list[bytes] = []
    a = src / "a.jsonl.gz"
    for i, line in enumerate(clean[:300]):
        out.append(line)
        published.append(line)
        if i < len(cases):
            out.append(cases[i][0])
            expected[(str(a), len(out))] = cases[i]
    out.append(clean[5])
    expected[(str(a), len(out))] = (clean[5], "event_id", "duplicate event_id")
    first = json.loads(clean[7])
    changed = mutate(clean[7], event_id=10**12, user_age=first["user_age"] + 1)
    out.append(changed)
    expected[(str(a), len(out))] = (changed, "user_age", "differs from the first event")
    _write_json(a, out, gz=True)

    # b.jsonl: a byte order mark; valid events with a 6 MB unknown field and an unknown field
    # nested 10,000 deep (unknown fields are ignored, however large or deep)
    b = clean[300:340]
    published += b
    b[3] = b[3][:-1] + b', "blob": "' + b"x" * (6 << 20) + b'"}'
    b[4] = b[4][:-1] + b', "tree": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    _write_json(src / "b.jsonl", b, bom=True)

    # a file name that is not UTF-8, holding one bad line
    latin1 = src / os.fsdecode(b"ev\xe9.jsonl")
    _write_json(latin1, [*clean[340:360], b"{broken"])
    published += clean[340:360]
    expected[(str(src) + "/ev\\xe9.jsonl", 21)] = (b"{broken", None, "invalid JSON")

    # skipped: hidden files and folders; a symlink loop
    (src / ".partial.jsonl").write_bytes(b"{half a li")
    (src / "_tmp").mkdir()
    (src / "_tmp" / "x.jsonl").write_bytes(b"garbage\n")
    (src / "loop").mkdir()
    (src / "loop" / "self").symlink_to("../loop")

    # Parquet under JSON's type rule: an export with its own widths is fine; a label of 300
    # rejects its row; ids as strings reject the file
    rows = [json.loads(x) for x in clean[360:400]]
    wide = pa.Table.from_pylist(rows[:20])  # int64 label, float64 dense, list<int64>
    labels = wide["label"].to_pylist()
    labels[4] = 300
    wide = wide.set_column(wide.schema.get_field_index("label"), "label", pa.array(labels))
    pq.write_table(wide, src / "wide.parquet")
    published += [x for i, x in enumerate(clean[360:380]) if i != 4]
    expected[(str(src / "wide.parquet"), 5)] = (None, "label", "integer 300 out of range for int8")
    strings = pa.Table.from_pylist(rows[20:])
    at = strings.schema.get_field_index("user_id")
    strings = strings.set_column(at, "user_id", strings["user_id"].cast(pa.string()))
    pq.write_table(strings, src / "strings.parquet")
    for i in range(20):
        expected[(str(src / "strings.parquet"), i + 1)] = (None, "user_id", "integers only")

    wh, summary = tmp_path / "wh", tmp_path / "s.json"
    recd(
        "ingest",
        "--source",
        src,
        "--warehouse",
        wh,
        "--ds",
        DAY,
        "--max-quarantine-fraction",
        1,
        "--summary",
        summary,
        code=0,
    )
    s = json.loads(summary.read_text())
    lines_in = len(out) + len(b) + 21 + 40
    assert s["ingest.rows_in"] == lines_in == s["ingest.rows_ok"] + s["ingest.rows_quarantined"]
    q = {(r["source"], r["line"]): r for r in Warehouse(wh).read("quarantine", DAY).to_pylist()}
    assert set(q) == set(expected), "exactly the bad lines are quarantined"
    for key, (raw, field, reason) in expected.items():
        row = q[key]
        assert reason in row["reason"] and row["field"] == field, (key, row)
        if raw is not None:
            assert row["raw"] == raw, f"{key}: the rejected bytes are kept exactly"
    events = Warehouse(wh).read("events", DAY)
    assert sorted(events["event_id"].to_pylist()) == sorted(
        json.loads(x)["event_id"] for x in published
    ), "every clean line is published"


def test_a_gzip_file_cut_short_publishes_the_lines_before_the_cut(day_logs, tmp_path):
    data = next(iter(sorted(day_logs.glob("*.gz")))).read_bytes()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    summary = tmp_path / "s.json"
    recd(
        "ingest",
        "--source",
        tmp_path / "src",
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--max-quarantine-fraction",
        1,
        "--summary",
        summary,
        code=0,
    )
    s = json.loads(summary.read_text())
    partial, cut = Warehouse(tmp_path / "wh").read("quarantine", DAY).to_pylist()
    assert partial["reason"].startswith("invalid JSON"), "the line the cut went through"
    assert "truncated" in cut["reason"] and cut["line"] == partial["line"] + 1
    assert s["ingest.rows_ok"] == partial["line"] - 1 > 100, "every line before the cut"
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] + 2


@pytest.mark.parametrize(
    "ds", ["20261101", "2026-W45-1", "2026-11-1", "2026-02-30", "../../etc", "2026-11-01/.."]
)
def test_only_a_canonical_date_names_a_partition(ds, day_logs, tmp_path):
    """`20261101` and the ISO week date `2026-W45-1` are the same day as `2026-11-01`: they
    would create a second partition of it; a path in `--ds` would escape the warehouse."""
    r = recd("ingest", "--source", day_logs, "--warehouse", tmp_path / "wh", "--ds", ds, code=2)
    assert "YYYY-MM-DD" in r.stderr
    assert not list((tmp_path / "wh").rglob("ds=*")), "no partition is created"


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_a_warehouse_that_cannot_be_written_is_one_line(kind, day_logs, tmp_path):
    wh = tmp_path / "wh"
    if kind == "a file":
        wh.write_text("not a directory")
        prefix, message = (), "cannot be used as a directory"
    else:
        (wh / "events").mkdir(parents=True, mode=0o555)
        prefix, message = _unprivileged(), "cannot be written"
    r = recd("ingest", "--source", day_logs, "--warehouse", wh, "--ds", DAY, code=2, prefix=prefix)
    assert message in r.stderr


def test_sources_that_cannot_be_read_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not parquet at all")
    for source, message in (
        (tmp_path / "nope", "source not found"),
        (tmp_path / "empty", "no input files"),
        (tmp_path / "x.parquet", "not a readable Parquet file"),
    ):
        r = recd("ingest", "--source", source, "--warehouse", tmp_path / "wh", "--ds", DAY, code=2)
        assert message in r.stderr


def test_a_config_with_a_python_yaml_tag_runs_no_code(day_logs, tmp_path):
    marker = tmp_path / "pwned"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"features: !!python/object/apply:os.system ['touch {marker}']\n")
    recd(
        "ingest",
        "--source",
        day_logs,
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--config",
        cfg,
        code=2,
    )
    assert not marker.exists()


class _Pwn:
    """Pickled, this calls `os.system` when loaded by an unsafe loader."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "files",
    [
        {"model.json": "{}", "model.pt": "garbage"},  # not a recd model
        {"model.json": '{"features": {"features": []}, "train": {}}', "model.pt": "x"},
        {"model.pt": "x"},  # half a model
        {"model.json": "real", "model.pt": "pickle"},  # a malicious pickle (written below)
        "../../../etc",  # a path that is no model at all
    ],
)
def test_a_damaged_or_malicious_model_is_one_line_about_the_model(files, tmp_path):
    """No traceback, no checkpoint advice, no code run (weights load with weights_only)."""
    import pickle

    marker = tmp_path / "pwned"
    if isinstance(files, str):
        model = files
    else:
        model = tmp_path / "model"
        model.mkdir()
        for name, text in files.items():
            if text == "pickle":  # what torch.save would write, plus a payload
                (model / name).write_bytes(pickle.dumps({"w": _Pwn(marker)}))
            elif text == "real":  # a valid model.json, so loading reaches the weights
                meta = {
                    "features": load_feature_set("synthetic").model_dump(mode="json"),
                    "train": {},
                }
                (model / name).write_text(json.dumps(meta))
            else:
                (model / name).write_text(text)
    r = recd(
        "evaluate",
        "--warehouse",
        tmp_path / "wh",
        "--model-uri",
        model,
        "--ds",
        "2026-11-01",
        code=2,
    )
    assert "checkpoint" not in r.stderr and str(model) in r.stderr, r.stderr
    assert not marker.exists(), "the pickle did not run"


def _unprivileged() -> tuple[str, ...]:
    """A prefix that makes root obey file permissions (CAP_DAC_OVERRIDE dropped)."""
    if os.geteuid() != 0:
        return ()
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: a read-only directory is writable")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


@pytest.mark.parametrize("store", ["read-only directory", "under a file"])
def test_a_tracking_store_that_cannot_be_written_fails_before_any_work(store, day_logs, tmp_path):
    """MLflow alone retries for ~2 minutes with a warning each time; recd checks first."""
    prefix: tuple[str, ...] = ()
    if store == "read-only directory":
        prefix = _unprivileged()
        (tmp_path / "ro").mkdir(mode=0o555)
        db = tmp_path / "ro" / "mlflow.db"
    else:
        (tmp_path / "file").write_text("x")
        db = tmp_path / "file" / "mlflow.db"
    summary = tmp_path / "s.json"
    r = recd(
        "ingest",
        "--source",
        day_logs,
        "--warehouse",
        tmp_path / "wh",
        "--ds",
        DAY,
        "--summary",
        summary,
        code=4,
        options=("--tracking-uri", f"sqlite:///{db}"),
        prefix=prefix,
    )
    assert "tracking store" in r.stderr and "cannot be written" in r.stderr  # one line (recd)
    assert json.loads(summary.read_text())["status"] == "failed", "the summary is written"
    assert not list((tmp_path / "wh").rglob("ds=*")), "no work was done"


def _ingest_day(src: Path, tmp_path: Path, *options: str, code: int = 0) -> dict:
    return ingest_day(src, tmp_path / "wh", DAY, tmp_path / "s.json", *options, code=code)


def test_every_member_of_a_concatenated_gzip_and_every_zstd_frame_is_read(day_logs, tmp_path):
    """`cat a.gz b.gz` (log rotation) is one valid gzip file: gzip -t and zcat read all of
    it, and so must ingest; zstd logs (common in production) likewise, frames and all."""
    lines = clean_lines(day_logs, 3000)
    a, b = b"\n".join(lines[:2000]) + b"\n", b"\n".join(lines[2000:]) + b"\n"
    src = tmp_path / "src"
    src.mkdir()
    (src / "rotated.jsonl.gz").write_bytes(gzip.compress(a) + gzip.compress(b))
    s = _ingest_day(src, tmp_path)
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] == 3000
    (src / "rotated.jsonl.gz").unlink()
    frames = []
    for part in (a, b):
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as z:
            z.write(part)
        frames.append(sink.getvalue().to_pybytes())
    (src / "events.jsonl.zst").write_bytes(b"".join(frames))
    s = _ingest_day(src, tmp_path)
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] == 3000
    events = Warehouse(tmp_path / "wh").read("events", DAY)
    assert sorted(events["event_id"].to_pylist()) == sorted(
        json.loads(x)["event_id"] for x in lines
    )


def _bomb(path: Path, gib: int) -> None:
    """`gib` GiB of zeros in about `gib` MB: 1 MiB members, each ~1 KB, concatenated."""
    member = gzip.compress(bytes(1 << 20))
    with path.open("wb") as f:
        for _ in range(gib):
            f.write(member * 1024)


def test_a_decompression_bomb_is_refused_whole_and_the_day_goes_on(day_logs, tmp_path):
    """A gzip file that expands 1000x is refused once it passes the ratio, long before
    memory fills; it is named in the summary and the quarantine (no bytes kept), the day's
    other files are published, and the counts add up (the file is one quarantine record)."""
    src = tmp_path / "src"
    shutil.copytree(day_logs, src)
    _bomb(src / "zeros.jsonl.gz", 1)
    lines = sum(len(gzip.decompress(p.read_bytes()).splitlines()) for p in day_logs.glob("*.gz"))
    s = _ingest_day(src, tmp_path)
    assert s["ingest.rows_ok"] == lines and s["ingest.files_refused"] == 1
    ((name, reason),) = s["ingest.refused_files"].items()
    assert name.endswith("zeros.jsonl.gz") and "decompression bomb" in reason
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] + s["ingest.rows_quarantined"]
    q = Warehouse(tmp_path / "wh").read("quarantine", DAY).to_pylist()
    assert [(r["line"], r["raw"]) for r in q] == [(0, b"")] and "file refused" in q[0]["reason"]
    # the size limit alone: a plain file past max_file_mb (set low here) is refused too
    lines = clean_lines(day_logs)
    assert sum(map(len, lines)) > 1 << 20
    plain = tmp_path / "plain"
    plain.mkdir()
    _write_json(plain / "small.jsonl", lines[:10])
    _write_json(plain / "big.jsonl", lines[10:])
    cfg = tmp_path / "limits.yaml"
    cfg.write_text("features: synthetic\ningest:\n  max_file_mb: 1\n")
    s = _ingest_day(plain, tmp_path, "--config", str(cfg), "--max-quarantine-fraction", "1")
    ((name, reason),) = s["ingest.refused_files"].items()
    assert name.endswith("big.jsonl") and "max_file_mb" in reason and s["ingest.rows_ok"] == 10


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "outside"])
def test_a_symlink_out_of_the_logs_is_named_and_never_read(target, day_logs, tmp_path):
    """A link in the logs directory to a file outside it: not followed, its contents never
    reach the quarantine; named in the summary with the reason."""
    if target == "outside":
        target = tmp_path / "elsewhere.jsonl"
        target.write_bytes(b"\n".join(clean_lines(day_logs, 10)) + b"\n")
    (day_logs / "leak.jsonl").symlink_to(target)
    s = _ingest_day(day_logs, tmp_path)
    ((name, reason),) = s["ingest.refused_files"].items()
    assert name.endswith("leak.jsonl") and "leads out of the source directory" in reason
    q = Warehouse(tmp_path / "wh").read("quarantine", DAY).to_pylist()
    assert [r["raw"] for r in q] == [b""], "nothing of the target was copied"
    assert s["ingest.rows_in"] == s["ingest.rows_ok"] + 1


def test_events_stamped_off_their_day_are_counted_and_quarantined_beyond_the_tolerance(
    day_logs, tmp_path
):
    lines = clean_lines(day_logs, 400)
    day_start = 1_793_491_200_000  # 2026-11-01T00:00Z
    late = [mutate(x, ts=day_start - 3_600_000) for x in lines[:50]]  # an hour early: kept
    future = [mutate(x, ts=day_start + 10 * 86_400_000) for x in lines[50:80]]  # 10 days on
    src = tmp_path / "src"
    src.mkdir()
    _write_json(src / "e.jsonl", [*late, *future, *lines[80:]])
    s = _ingest_day(src, tmp_path, "--max-quarantine-fraction", "1")
    assert s["ingest.rows_out_of_day"] == 80
    assert s["ingest.rows_ok"] == 370 and s["ingest.rows_quarantined"] == 30
    q = Warehouse(tmp_path / "wh").read("quarantine", DAY).to_pylist()
    assert {r["field"] for r in q} == {"ts"}
    assert all("after ds=2026-11-01, beyond the tolerance" in r["reason"] for r in q)


def test_a_parquet_export_too_large_once_decompressed_is_refused_before_reading(day_logs, tmp_path):
    """The footer says how large the row groups are decompressed: a file past the limits is
    refused whole before a page is read (a column of zeros compresses ~1000x)."""
    src = tmp_path / "src"
    src.mkdir()
    rows = [json.loads(x) for x in clean_lines(day_logs, 20)]
    pq.write_table(pa.Table.from_pylist(rows), src / "fine.parquet")
    zeros = pa.table(
        {
            "event_id": pa.array(range(4_000_000), pa.int64()),
            "blob": pa.array([0] * 4_000_000, pa.int64()),
        }
    )
    pq.write_table(zeros, src / "zeros.parquet", compression="zstd", use_dictionary=False)
    cfg = tmp_path / "limits.yaml"
    cfg.write_text("features: synthetic\ningest:\n  max_file_mb: 16\n")
    s = _ingest_day(src, tmp_path, "--config", str(cfg), "--max-quarantine-fraction", "1")
    ((name, reason),) = s["ingest.refused_files"].items()
    assert name.endswith("zeros.parquet") and "max_file_mb" in reason
    assert s["ingest.rows_ok"] == 20 and s["ingest.rows_in"] == 21
