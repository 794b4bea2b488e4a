"""`recd generate`: a day's events -> training samples, in RecD's layout or the baseline's.

  clustered  the rows of a session contiguous; sessions ordered by user, then start time
             (RecD). Consecutive rows repeat the same user-side values, so Parquet's
             compression sees the repeats within a page, and every training batch of
             contiguous rows holds many duplicates.
  shuffled   a seeded random order (the usual training-data layout: the baseline).

Both are Parquet (zstd, dictionary encoding, tunable row groups). The summary reports the
partition's bytes, the dedup profile at the configured batch size and the storage lower
bound: the bytes of the same samples with each session's user-side features stored once
(a per-session table plus a per-sample table, written with the same options).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recd_core.config import FeatureSet, GenerateConfig
from recd_core.dedup.unique import batch_factors, dedup_profile, group_hashes
from recd_core.schema import feature_set_of
from recd_core.warehouse import Warehouse

LAYOUTS = ("clustered", "shuffled")


def session_clustered_order(table: pa.Table, user_key: str) -> np.ndarray:
    """Row order: by user, then session start time, then session, then time within it."""
    sid = np.asarray(table["session_id"])
    ts = np.asarray(table["ts"])
    user = np.asarray(table[user_key])
    eid = np.asarray(table["event_id"])
    by_session = np.lexsort((ts, sid))
    s_sorted = sid[by_session]
    first = np.concatenate([[True], s_sorted[1:] != s_sorted[:-1]])
    group = np.cumsum(first) - 1
    start = ts[by_session][first][group]  # session start, per row in by_session order
    session_start = np.empty_like(ts)
    session_start[by_session] = start
    return np.lexsort((eid, ts, sid, session_start, user))


def layout_order(table: pa.Table, features: FeatureSet, layout: str, seed: int) -> np.ndarray:
    if layout == "clustered":
        return session_clustered_order(table, features.user_key)
    if layout == "shuffled":
        return np.random.default_rng(seed).permutation(table.num_rows)
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def write_samples(
    warehouse: Warehouse, ds: str, layout: str, samples: pa.Table, cfg: GenerateConfig
):
    """Publish `samples/layout=<layout>/ds=<ds>` with the layout's Parquet options; the
    committed writer (its `info`: files, rows, bytes)."""
    opts = parquet_options(cfg, samples.schema, layout)
    with warehouse.writing("samples", ds, layout=layout) as w:
        w.write(samples, max_rows_per_file=cfg.max_rows_per_file, **opts)
    return w


def parquet_options(cfg: GenerateConfig, schema: pa.Schema, layout: str) -> dict:
    list_dict = cfg.list_dictionary if cfg.list_dictionary is not None else layout != "clustered"
    is_list = [pa.types.is_list(f.type) for f in schema]
    return {
        "compression": None if cfg.compression == "none" else cfg.compression,
        "compression_level": cfg.compression_level if cfg.compression != "none" else None,
        "use_dictionary": True
        if list_dict
        else [f.name for f, lst in zip(schema, is_list, strict=True) if not lst],
        "row_group_size": cfg.row_group_size,
    }


def parquet_bytes(table: pa.Table, cfg: GenerateConfig) -> int:
    sink = pa.BufferOutputStream()
    opts = parquet_options(cfg, table.schema, "clustered")
    row_group_size = opts.pop("row_group_size")
    pq.write_table(table, sink, row_group_size=row_group_size, **opts)
    return sink.getvalue().size


def storage_lower_bound(
    samples: pa.Table, features: FeatureSet, cfg: GenerateConfig, order: np.ndarray | None = None
) -> int:
    """Bytes with each session's user-side features stored once (same order and options);
    `order`: the session-clustered order, if already computed."""
    if order is None:
        order = session_clustered_order(samples, features.user_key)
    clustered = samples.take(pa.array(order))
    sid = np.asarray(clustered["session_id"])
    first = np.flatnonzero(np.concatenate([[True], sid[1:] != sid[:-1]]))
    user_cols = [f.name for f in features.by_side("user")]
    sessions = clustered.select(["session_id", *user_cols]).take(pa.array(first))
    per_sample = clustered.drop_columns(user_cols)
    return parquet_bytes(sessions, cfg) + parquet_bytes(per_sample, cfg)


def generate(
    warehouse: Warehouse,
    ds: str,
    cfg: GenerateConfig,
    layouts: tuple[str, ...] = ("clustered",),
    progress=None,
) -> dict:
    """Write `samples/layout=<L>/ds=<ds>` for each layout; return the summary."""
    t0 = time.perf_counter()
    events = warehouse.read("events", ds)
    features = feature_set_of(events.schema)
    list_features = [f.name for f in features.features if f.is_list]
    user_cols = [f.name for f in features.by_side("user")]
    summary: dict = {"generate.layouts": list(layouts)}
    per_layout: dict[str, dict] = {}
    clustered_order = None
    for layout in layouts:
        order = layout_order(events, features, layout, cfg.shuffle_seed)
        if layout == "clustered":
            clustered_order = order
        samples = events.take(pa.array(order))
        w = write_samples(warehouse, ds, layout, samples, cfg)
        profile = dedup_profile(samples, [f.name for f in features.features], cfg.batch_size)
        user_group = float(batch_factors(group_hashes(samples, user_cols), cfg.batch_size).mean())
        stats = {
            "storage.bytes": w.info.bytes,
            "storage.rows": w.info.rows,
            "storage.bytes_per_sample": w.info.bytes / max(w.info.rows, 1),
            "storage.sessions": int(len(np.unique(np.asarray(samples["session_id"])))),
            "storage.files": len(w.info.files),
            **{f"dedup.factor.{k}": v for k, v in profile.items()},
            # the mean over list features: where dedup saves work (transforms, pooling, the
            # history encoder); scalar ids like gender would swamp it with huge factors.
            "dedup.factor.mean": float(np.mean([profile[f] for f in list_features]))
            if list_features
            else 1.0,
            "dedup.factor.user_group": user_group,
        }
        per_layout[layout] = stats
        if progress:
            progress(layout, 1)
    bound = storage_lower_bound(events, features, cfg, clustered_order)
    for stats in per_layout.values():
        stats["storage.lower_bound_bytes"] = bound
        stats["storage.bytes_over_lower_bound"] = stats["storage.bytes"] / bound if bound else 0.0
    # The requested (first) layout's figures use the contract keys at the top level.
    summary.update(per_layout[layouts[0]])
    if len(layouts) > 1:
        summary["layouts"] = per_layout
    if {"clustered", "shuffled"} <= per_layout.keys():
        summary["storage.ratio"] = (
            per_layout["shuffled"]["storage.bytes"] / per_layout["clustered"]["storage.bytes"]
        )
    summary["generate.seconds"] = time.perf_counter() - t0
    summary["generate.batch_size"] = cfg.batch_size
    return summary
