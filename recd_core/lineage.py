"""Lineage: every partition knows what it was built from, and every stage checks it.

Each stage that writes a partition records in its manifest (and a model in its
model.json) what it was built from:

    "lineage": {
      "stage":    "generate",                       the stage that wrote it
      "inputs":   {"events/ds=2026-11-01": "3f1c…"}, each input partition's write id
      "peers":    {"events/ds=2026-10-31": "77ab…"}, ingest: the days its redelivery check
                                                    read (compared, not walked further up)
      "logs":     {"path": …, "digest": …, "files": n}   ingest: the raw files it read
      "features": {"user_id": "9a0b…", …},          a digest per feature of the config's
                                                    feature set (what shaped the rows)
      "config":   "c41d…",                          a digest of the stage's config fields
                                                    that shape its output (not engines,
                                                    workers or threads)
      "code":     "0.1.0+5e2a…"                     recd's version and a digest of its source
    }

A partition is **stale** when one of its inputs or peers was rewritten since (its write id
moved), when an input is itself stale (transitively: a peer's own lineage is not walked, or
every day would depend on every day before it), or when the raw logs an events partition
was ingested from changed since. Before a stage reads a partition it calls `require_fresh`: a
stale input is refused in one line (exit 2) naming the partition, why, and the stage to
re-run; `recd run` and the DAGs re-run every stage of a day in order, so what they rebuild
is fresh. A partition written before lineage was recorded, or by hand, is "unknown": read,
and shown as such by `recd status`. An input that is gone (retention) does not make its
outputs stale. The code version is recorded and shown, not judged: new code does not make
yesterday's rows wrong.

The config's feature set is checked against the stored one (`require_features`): a stage
run with a config whose features differ from what the partition was built with is refused
naming the features, never silently run on the stored ones.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pyarrow.fs as pafs

from recd_core.config import FeatureSet
from recd_core.errors import BadInput, first_line
from recd_core.stored_files import PartitionDamaged
from recd_core.warehouse import Warehouse

# the stage that writes each table (the pipeline's graph declares it; `status` and the
# refusals name it)
WRITTEN_BY = {
    "events": "ingest",
    "quarantine": "ingest",
    "samples": "generate",
    "batches": "preprocess",
    "models": "train",
}


class StaleInput(BadInput):
    """An input partition is stale (rewritten upstream since it was built): re-run the stage
    the message names; a retry of this one cannot help."""


class FeaturesDiffer(BadInput):
    """The config's feature set is not the one a stored partition was built with."""


def digest(obj) -> str:
    """A short, stable digest of a JSON-able object."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def code_version() -> str:
    """recd's version and a digest of its source files (an image without git has them)."""

    try:
        v = version("recd")
    except PackageNotFoundError:
        v = "0"
    h = hashlib.sha256()
    root = Path(__file__).parent
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return f"{v}+{h.hexdigest()[:10]}"


def feature_digests(features: FeatureSet) -> dict[str, str]:
    """A digest per feature (its whole spec), and the set's keys under `_keys`."""
    out = {f.name: digest(f.model_dump(mode="json")) for f in features.features}
    out["_keys"] = digest([features.name, features.user_key, features.item_key])
    return out


def record(
    stage: str,
    inputs: dict[str, str],
    config=None,
    features: FeatureSet | dict | None = None,
    logs: dict | None = None,
    peers: dict[str, str] | None = None,
) -> dict:
    """The `lineage` entry of a partition `stage` writes: `inputs` {partition: write id},
    `config` the fields that shaped it (a pydantic model or a dict), `features` the feature
    set its rows follow (or the digests its input recorded: carried down from ingest),
    `logs` (ingest) the raw files read (`logs_digest`)."""
    if config is not None and hasattr(config, "model_dump"):
        config = config.model_dump(mode="json", exclude=EXECUTION_FIELDS)
    out = {"stage": stage, "inputs": dict(inputs), "code": code_version()}
    if config is not None:
        out["config"] = digest(config)
    if features is not None:
        out["features"] = features if isinstance(features, dict) else feature_digests(features)
    if logs is not None:
        out["logs"] = logs
    if peers:
        out["peers"] = dict(peers)
    return out


# fields that say how a stage runs, not what it writes
EXECUTION_FIELDS = {
    "engine",
    "workers",
    "executor",
    "threads",
    "device",
    "nproc",
    "spill_dir",
    "memory_budget_mb",
    "max_file_mb",
    "max_expansion_ratio",
    "checkpoint_every",
    "keep_checkpoints",
    "timeout_minutes",
    "max_quarantine_fraction",
}


def write_ids(wh: Warehouse, table: str, days: list[str], **keys: str) -> dict[str, str]:
    """{partition: write id} of `table`'s partitions on `days` that exist (inputs to record)."""
    return {
        wh.partition_name(table, d, **keys): str(wh.manifest(table, d, **keys).get("write_id"))
        for d in days
        if wh.exists(table, d, **keys)
    }


def logs_digest(source: str | Path) -> dict:
    """What ingest read, as a digest of each file's name, size and modification time: late
    files, a redelivery or a rewrite change it."""
    p = Path(source)
    if p.is_file():
        st = p.stat()
        stats = [(p.name, st.st_size, st.st_mtime_ns)]
    else:  # os.walk, not Path.rglob: a day of 4,000 files was 0.3 s of pathlib objects
        found = []
        for dirpath, _, names in os.walk(p, followlinks=True):
            rel = os.path.relpath(dirpath, p)
            parts = [] if rel == "." else rel.split(os.sep)
            for name in names:  # what ingest reads: not hidden or marker files (`_SUCCESS`)
                if not any(x.startswith((".", "_")) for x in (*parts, name)):
                    found.append([*parts, name])
        stats = []
        for parts in sorted(found):
            full = os.path.join(p, *parts)
            if os.path.isfile(full):
                st = os.stat(full)
                stats.append(("/".join(parts), st.st_size, st.st_mtime_ns))
    return {"path": str(p.resolve()), "digest": digest(stats), "files": len(stats)}


def parse_name(name: str) -> tuple[str, str, dict[str, str]]:
    """`samples/layout=clustered/ds=D` as ("samples", "D", {"layout": "clustered"})."""
    parts = name.split("/")
    keys = dict(p.split("=", 1) for p in parts[1:-1])
    return parts[0], parts[-1].removeprefix("ds="), keys


@dataclass(frozen=True)
class Stale:
    """Why a partition is stale: `root` is the partition to rebuild first (its `stage`),
    `reason` what changed under it; `via` the stale partitions between (downstream order)."""

    partition: str
    root: str
    reason: str
    via: tuple[str, ...] = ()

    @property
    def stage(self) -> str:
        return WRITTEN_BY.get(parse_name(self.root)[0], "the stage that writes it")

    def brief(self) -> str:
        """What changed and the stage to re-run (`recd status`'s words)."""
        ds = parse_name(self.root)[1][:10]  # a model's run name starts with its day
        what = self.reason
        if self.root != self.partition:
            what = f"built on {' <- '.join(self.via)}, which is stale: {self.reason}"
        return (
            f"{what}: rerun `recd {self.stage} --ds {ds}` and the stages after it (or `recd run`)"
        )

    def line(self, reader: str | None = None) -> str:
        """The one line a stage refuses a stale input with."""
        return f"{reader + ': ' if reader else ''}{self.partition} is stale: {self.brief()}"


def lineage_of(wh: Warehouse, name: str) -> dict | None:
    """A partition's recorded lineage (None: not recorded, or no such partition)."""
    table, ds, keys = parse_name(name)
    if not wh.exists(table, ds, **keys):
        return None
    return wh.manifest(table, ds, **keys).get("lineage")


def staleness(
    wh: Warehouse, name: str, lineage: dict | None = None, _memo: dict | None = None
) -> Stale | None:
    """Why partition `name` (or what `lineage` describes, e.g. a model) is stale; None when
    fresh or unknown. Walks the inputs upstream (a few manifests)."""
    memo = {} if _memo is None else _memo
    if lineage is None:
        if name in memo:
            return memo[name]
        lineage = lineage_of(wh, name)
    found = None
    if lineage:
        found = _own_staleness(wh, name, lineage)
        peers = lineage.get("peers") or {}
        for inp, wid in {**(lineage.get("inputs") or {}), **peers}.items():
            if found:
                break
            table, ds, keys = parse_name(inp)
            if not wh.exists(table, ds, **keys):
                continue  # gone: retention, not a change
            now = str(wh.manifest(table, ds, **keys).get("write_id"))
            if now != wid:
                found = Stale(
                    name, name, f"built from {inp} write {wid}, rewritten since (now {now})"
                )
                break
            up = None if inp in peers else staleness(wh, inp, None, memo)
            if up:
                found = Stale(name, up.root, up.reason, (inp, *up.via))
    memo[name] = found
    return found


def _own_staleness(wh: Warehouse, name: str, lineage: dict) -> Stale | None:
    """Stale for what the partition read outside the warehouse: ingest's raw logs."""
    logs = lineage.get("logs")
    if not logs or not Path(logs["path"]).exists():
        return None  # logs mounted elsewhere (a pod), or retired: nothing to compare
    now = logs_digest(logs["path"])
    if now["digest"] == logs["digest"]:
        return None
    files = now["files"] - logs["files"]
    more = f" ({files:+d} files)" if files else ""
    return Stale(name, name, f"its logs in {logs['path']} changed since it was ingested{more}")


def require_fresh(wh: Warehouse, reader: str, names: list[str]) -> dict[str, str]:
    """Refuse (StaleInput, exit 2) when any of the partitions `names` that `reader` is about
    to read is stale; their write ids, for the reader's own lineage."""
    memo: dict = {}
    for name in names:
        found = staleness(wh, name, None, memo)
        if found:
            raise StaleInput(found.line(reader))
    out = {}
    for name in names:
        table, ds, keys = parse_name(name)
        out[name] = str(wh.manifest(table, ds, **keys).get("write_id"))
    return out


def check_reads(
    wh: Warehouse, reader: str, reads: list[str], features: FeatureSet | None = None
) -> tuple[dict[str, str], dict | None]:
    """What a stage does before it reads: `reads` fresh (`require_fresh`), and the first of
    them built with the config's `features` (`require_features`). Their write ids and the
    feature digests it was built with: the stage's own lineage carries both down."""
    inputs = require_fresh(wh, reader, reads)
    stored = stored_features(wh, reads[0])
    if features is not None:
        require_features(reads[0], stored, features, reader)
    return inputs, stored


def require_features(
    name: str, stored: FeatureSet | dict | None, config: FeatureSet, reader: str
) -> None:
    """Refuse (FeaturesDiffer) a config whose feature set is not the one partition `name`
    was built with (`stored`: the feature set, or its recorded digests), naming the
    features that differ."""
    if stored is None:
        return
    theirs = stored if isinstance(stored, dict) else feature_digests(stored)
    ours = feature_digests(config)
    if theirs == ours:
        return
    dropped = [n for n in theirs if n not in ours and n != "_keys"]
    added = [n for n in ours if n not in theirs and n != "_keys"]
    changed = [n for n in ours if n in theirs and ours[n] != theirs[n] and n != "_keys"]
    words = [
        *(f"{n!r} not in the config" for n in dropped),
        *(f"{n!r} not in the stored data" for n in added),
        *(f"{n!r} defined differently" for n in changed),
    ]
    if ours.get("_keys") != theirs.get("_keys"):
        words.append("the feature set's name or user/item keys differ")
    shown = "; ".join(words[:5]) + (f"; and {len(words) - 5} more" if len(words) > 5 else "")
    _, ds, _ = parse_name(name)
    raise FeaturesDiffer(
        f"{reader}: the config's feature set is not the one {name} was built with ({shown}): "
        f"rerun `recd ingest --ds {ds}` and the stages after it with this config "
        "(or `recd run`), or use the config it was built with"
    )


def stored_features(wh: Warehouse, name: str) -> dict | None:
    """The feature digests partition `name` was built with (None: not recorded)."""
    lineage = lineage_of(wh, name)
    return (lineage or {}).get("features")


DAY_TABLES = ("events", "quarantine", "samples", "batches")


def status(wh: Warehouse, ds: str, features: FeatureSet | None = None) -> list[dict]:
    """Every partition of day `ds` and every model trained on it, upstream first, as rows:
    `partition`, `write_id`, `written_at`, `rows`, `inputs` ({partition: write id}),
    `state` (fresh, stale, unknown: no lineage recorded, damaged) and `why`. With the
    config's `features`, a partition built with another feature set is marked so."""

    rows, memo = [], {}
    for table in DAY_TABLES:
        for keys in wh.keys_on(table, ds):
            name = wh.partition_name(table, ds, **keys)
            try:
                m = wh.manifest(table, ds, **keys)
                wrong = _wrong_fields(m)
                if wrong:
                    raise PartitionDamaged(f"its manifest's {wrong} is not what recd writes")
                row = _row(
                    wh,
                    name,
                    m.get("write_id"),
                    m.get("written_at"),
                    m.get("rows"),
                    m.get("lineage"),
                    features,
                    memo,
                )
            except (PartitionDamaged, FileNotFoundError, ValueError) as e:
                row = {"partition": name, "state": "damaged", "why": str(e)}
            rows.append(row)
    for run in _models_of(wh, ds):
        meta = _model_json(wh, run)
        if meta is None:
            rows.append(
                {
                    "partition": f"models/{run}",
                    "state": "damaged",
                    "why": "model.json missing or unreadable",
                }
            )
            continue
        lineage = meta.get("lineage")
        when = wh.fs.get_file_info(f"{wh.root}/models/{run}/model.json").mtime
        row = _row(
            wh,
            f"models/{run}",
            None,
            when and when.astimezone(dt.UTC).isoformat(timespec="seconds"),
            meta.get("summary", {}).get("train.samples"),
            lineage,
            features,
            memo,
        )
        if lineage:
            row["trained_days"] = lineage.get("trained_days", [])
        rows.append(row)
    return rows


def _wrong_fields(m: dict) -> str | None:
    """The first field of manifest `m` that status reads and that is not of the type recd
    writes (a hand-edited or damaged manifest), or None."""
    lineage = m.get("lineage")
    checks = {
        "write_id": (str, type(None)),
        "written_at": (str, type(None)),
        "rows": (int, type(None)),
        "lineage": (dict, type(None)),
    }
    for field, types in checks.items():
        if not isinstance(m.get(field), types) or isinstance(m.get(field), bool):
            return field
    for field in ("inputs", "peers", "logs"):
        if not isinstance((lineage or {}).get(field) or {}, dict):
            return f"lineage.{field}"
    return None


def _row(wh, name, write_id, written_at, nrows, lineage, features, memo) -> dict:
    inputs = {**(lineage or {}).get("inputs", {}), **(lineage or {}).get("peers", {})}
    row = {
        "partition": name,
        "write_id": write_id,
        "written_at": written_at,
        "rows": nrows,
        "inputs": inputs,
        "code": (lineage or {}).get("code"),
    }
    if (lineage or {}).get("logs"):
        logs = lineage["logs"]
        row["logs"] = f"{logs['path']} ({logs['files']} files, {logs['digest']})"
    if not lineage:
        return {
            **row,
            "state": "unknown",
            "why": "no lineage recorded (written by hand or by an older recd)",
        }
    try:
        found = staleness(wh, name, lineage if name.startswith("models/") else None, memo)
    except (PartitionDamaged, AttributeError, TypeError, KeyError) as e:
        # an input's manifest damaged (its own row says how): what was built from it follows
        return {**row, "state": "stale", "why": f"an input is damaged ({first_line(e, 200)})"}
    if found:
        return {**row, "state": "stale", "why": found.brief()}
    if features is not None and lineage.get("features") not in (None, feature_digests(features)):
        try:
            require_features(name, lineage["features"], features, "status")
        except FeaturesDiffer as e:
            return {**row, "state": "stale", "why": str(e).removeprefix("status: ")}
    return {**row, "state": "fresh", "why": ""}


def _models_of(wh: Warehouse, ds: str) -> list[str]:
    """The training runs of day `ds` (`models/<ds>-<mode>-<key>`)."""

    base = f"{wh.root}/models"
    if wh.fs.get_file_info(base).type != pafs.FileType.Directory:
        return []
    infos = wh.fs.get_file_info(pafs.FileSelector(base))
    return sorted(
        i.base_name
        for i in infos
        if i.type == pafs.FileType.Directory and i.base_name.startswith(f"{ds}-")
    )


def _model_json(wh: Warehouse, run: str) -> dict | None:
    try:
        with wh.fs.open_input_stream(f"{wh.root}/models/{run}/model.json") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
