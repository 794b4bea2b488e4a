"""Typed configuration: feature specs, dataset and stage configs (read from YAML by
config_files.py).

Everything a stage needs arrives as one of these objects; nothing reads the environment
behind the caller's back. A bad value fails with `ConfigError` naming the dotted path of
every offending field.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from recd_core.errors import BadInput

PACKAGE_CONFIGS = Path(__file__).parent / "configs"

Side = Literal["user", "item", "context"]
Kind = Literal["dense", "sparse", "id_list", "sequence"]
Identifier = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)]


class ConfigError(BadInput, ValueError):
    """A configuration file or object that does not validate; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FeatureSpec(_Strict):
    """One model input.

    kind:
      dense     `dim` finite floats per sample (a list of length `dim`, or a scalar if dim=1)
      sparse    one non-negative id per sample, mapped to one of `table_size` rows (`hash`)
      id_list   a variable-length list of ids, at most `max_length` long
      sequence  an ordered id list (the user history), at most `max_length` long
    hash: how an id finds its embedding row. True (default): DPP hashes it into `table_size`
      rows, so any non-negative id works (raw 64-bit ids from a log); ids then share rows
      (with as many rows as distinct ids, 63% of the ids share theirs). False: the ids
      already are row indices below `table_size` (a vocabulary-mapped log, the synthetic
      generator's ids): no two share a row, and ingest quarantines an id at or beyond
      `table_size`.
    side: which entity owns the value. User-side values are snapshotted at session start and
      are identical for every sample of a session: that is the duplication RecD removes.
    """

    name: Identifier
    side: Side
    kind: Kind
    table_size: int | None = Field(default=None, gt=0)
    max_length: int | None = Field(default=None, gt=0)
    dim: int = Field(default=1, gt=0, le=4096)
    hash: bool = True
    required: bool = True
    synth_length: tuple[int, int] | None = Field(
        default=None, description="length range the synthetic generator draws lists from"
    )
    # features naming the same `table` share one embedding table (same `table_size`): ids
    # from one space, e.g. a user's followed creators and an item's creator, or the user's
    # clicked items and the shown item; by default every feature has its own table
    table: Identifier | None = None

    @model_validator(mode="after")
    def _kind_fields(self) -> FeatureSpec:
        if self.kind == "dense":
            if self.table_size is not None or self.max_length is not None:
                raise ValueError("a dense feature takes `dim`, not `table_size`/`max_length`")
            if self.table is not None:
                raise ValueError("a dense feature has no embedding `table`")
            if not self.hash:
                raise ValueError("`hash` is for id features only")
        else:
            if self.table_size is None:
                raise ValueError(f"a {self.kind} feature needs `table_size`")
            if self.dim != 1:
                raise ValueError("`dim` is for dense features only")
        is_list = self.kind in ("id_list", "sequence")
        if is_list and self.max_length is None:
            raise ValueError(f"a {self.kind} feature needs `max_length`")
        if not is_list and (self.max_length is not None or self.synth_length is not None):
            raise ValueError("`max_length`/`synth_length` are for id_list and sequence features")
        if self.synth_length is not None:
            lo, hi = self.synth_length
            if not 0 <= lo <= hi <= (self.max_length or 0):
                raise ValueError("`synth_length` must satisfy 0 <= low <= high <= max_length")
        return self

    @property
    def is_list(self) -> bool:
        return self.kind in ("id_list", "sequence")


class FeatureSet(_Strict):
    """The schema of a dataset: its features and which of them identify users and items."""

    name: Identifier
    user_key: Identifier = "user_id"
    item_key: Identifier = "item_id"
    features: list[FeatureSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _keys(self) -> FeatureSet:
        names = [f.name for f in self.features]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate feature names: {dupes}")
        reserved = set(names) & set(ENVELOPE_COLUMNS)
        if reserved:
            raise ValueError(f"feature names clash with envelope columns: {sorted(reserved)}")
        sizes: dict[str, set[int | None]] = {}
        for f in self.features:
            if f.table is not None:
                sizes.setdefault(f.table, set()).add(f.table_size)
        for table, found in sizes.items():
            if len(found) > 1:
                raise ValueError(f"features sharing table {table!r} differ in table_size")
        for key, side in ((self.user_key, "user"), (self.item_key, "item")):
            spec = next((f for f in self.features if f.name == key), None)
            if spec is None or spec.side != side or spec.kind != "sparse":
                raise ValueError(f"`{key}` must name a {side}-side sparse feature")
        return self

    def table_of(self, name: str) -> str:
        """The embedding table a feature looks up: its `table`, or its own name."""
        return self[name].table or name

    def by_side(self, side: Side) -> list[FeatureSpec]:
        return [f for f in self.features if f.side == side]

    def __contains__(self, name: object) -> bool:
        return any(f.name == name for f in self.features)

    def __getitem__(self, name: str) -> FeatureSpec:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)


# Columns every event and sample carries besides the features, with their Arrow types
# (schema.py builds the fields from these).
ENVELOPE_COLUMNS = {"event_id": "int64", "ts": "int64", "session_id": "int64", "label": "int8"}


class SynthConfig(_Strict):
    """The synthetic workload (data/synth.py). Presets live in `SYNTH_PRESETS`."""

    users: int = Field(gt=0)
    items: int = Field(gt=1)
    samples_per_day: int = Field(gt=0, le=10**8)  # a day's ids span 10**8 (synth.IDS_PER_DAY)
    mean_session_length: float = Field(default=12.0, ge=1.0)
    max_session_length: int = Field(default=64, ge=1)
    latent_dim: int = Field(default=8, gt=0)
    topics: int = Field(default=16, gt=0)
    targeted_share: float = Field(
        default=0.4, ge=0.0, le=1.0
    )  # impressions aimed at the user's topic
    topic_effect: float = 2.0  # click logit added when user and item topics match
    item_zipf: float = Field(default=1.1, gt=1.0)
    base_ctr_logit: float = -2.0
    seed: int = 0
    start_date: dt.date = dt.date(2026, 11, 1)
    days: int = Field(default=1, gt=0, le=366)

    @model_validator(mode="after")
    def _lengths(self) -> SynthConfig:
        if self.mean_session_length > self.max_session_length:
            raise ValueError("mean_session_length must not exceed max_session_length")
        return self


SYNTH_PRESETS: dict[str, dict[str, Any]] = {
    # Runs in seconds: the tests.
    "small": {"users": 400, "items": 2_000, "samples_per_day": 4_000},
    # The embedded `make run` default: big enough that a model trained on one day clearly
    # beats the base rate the next day (next-day NE ~0.91, oracle ~0.74), done in a minute.
    "default": {"users": 1_000, "items": 5_000, "samples_per_day": 50_000},
    # The benchmark workload: about 200k samples a day.
    "standard": {"users": 20_000, "items": 100_000, "samples_per_day": 200_000},
}


class IngestConfig(_Strict):
    format: Literal["events", "movielens"] = "events"
    max_quarantine_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    # MovieLens: a new session starts after this many seconds without a rating.
    session_gap_s: int = Field(default=30 * 60, gt=0)
    label_min_rating: float = 4.0
    # user-side values must be the same for every event of a session (RecD's premise);
    # an event that differs from its session's first event is quarantined
    check_sessions: bool = True
    # where files are parsed: `workers` threads here, or `workers` Ray tasks on Ray Data
    # (the cluster of RAY_ADDRESS, or a local instance); the output is the same
    engine: Literal["local", "ray"] = "local"
    workers: int = Field(default=2, gt=0)
    # A source file is held whole while one of `workers` threads parses it: one that
    # expands past max_file_mb, or more than max_expansion_ratio times its compressed size
    # (judged past 64 MiB), is refused as a whole (a quarantine record and the summary's
    # ingest.refused_files name it), so no file, a decompression bomb included, takes ingest
    # past ~workers x 2 x max_file_mb of memory; the day's other files go on.
    max_file_mb: int = Field(default=512, gt=0)
    max_expansion_ratio: float = Field(default=100.0, gt=1.0)
    # Events stamped outside the partition's day (ts, UTC): late arrivals from before the
    # day's start up to ts_before_day_s and clock skew past its end up to ts_after_day_s are
    # kept; beyond those they are quarantined with the reason. Both kinds are counted in
    # ingest.rows_out_of_day. MovieLens ratings keep their own dates and are not checked.
    ts_before_day_s: int = Field(default=86_400, ge=0)
    ts_after_day_s: int = Field(default=3_600, ge=0)
    # Events once: an event_id already published in the events of the `dedup_window_days`
    # days before (or after: a day ingested late) is a redelivery (the same events
    # delivered again across midnight), and quarantined naming the day it was published
    # on; so an evaluation day never holds a training day's events. 0: off. Event logs only (a MovieLens export is one
    # table, its ids line numbers)
    dedup_window_days: int = Field(default=1, ge=0, le=31)


class ParquetWrite(_Strict):
    """How the warehouse's Parquet files are written: by ingest (events) and by generate
    (samples, whose config carries these fields)."""

    row_group_size: int = Field(default=65_536, gt=0)
    compression: Literal["zstd", "snappy", "gzip", "lz4", "none"] = "zstd"
    compression_level: int | None = 3
    # a CRC-32 in every page header, verified by every warehouse reader: a damaged file is
    # an error naming it (PartitionDamaged), never values trained on
    page_checksum: bool = True

    def options(self) -> dict:
        """pyarrow's writer options (`none`: uncompressed, and no level)."""
        none = self.compression == "none"
        return {
            "compression": None if none else self.compression,
            "compression_level": None if none else self.compression_level,
            "row_group_size": self.row_group_size,
            "write_page_checksum": self.page_checksum,
        }


class GenerateConfig(ParquetWrite):
    """How samples are laid out and written (Parquet) and how dedup is profiled."""

    batch_size: int = Field(default=4096, gt=0)
    max_rows_per_file: int = Field(default=1_000_000, gt=0)
    # Dictionary-encode list columns? None = each layout's better choice: plain for
    # `clustered` (repeated lists stay byte-aligned, so zstd removes the repeats; bit-packed
    # dictionary indices shift by bits and hide them), dictionary for `shuffled`.
    list_dictionary: bool | None = None
    shuffle_seed: int = 0
    # Store the clustered layout session-normalized (a session's user-side features once, in
    # a side file beside each data file; warehouse.py's module doc) where ingest checked the
    # sessions: the storage lower bound, and DPP's dedup never decodes a repeated value.
    # Readers through the warehouse see whole rows either way; false writes plain files for
    # engines that read the Parquet files directly.
    normalize_sessions: bool = True
    # Memory the stage may hold for rows (the order keys, ~32 bytes a row, come on top):
    # generate moves rows through local spill files a bucket of this size at a time.
    memory_budget_mb: int = Field(default=512, ge=16)
    # where rows are spilled (None: the system's temporary directory); with the Ray engine on
    # a cluster, a directory every Ray node mounts (so is the warehouse, if it is local)
    spill_dir: str | None = None
    # where the spilling and the output files are done: here, one after another, or as Ray
    # tasks (`workers` at a time) on the cluster of RAY_ADDRESS or a local instance; the
    # partitions and figures are the same
    engine: Literal["local", "ray"] = "local"
    workers: int = Field(default=2, gt=0)


class ModelConfig(_Strict):
    """The DLRM's shape (modeling/model.py)."""

    embedding_dim: int = Field(default=32, gt=0)
    bottom_mlp: list[int] = [64]
    top_mlp: list[int] = [128, 64]
    pooling: str = Field(default="mean", pattern="^(sum|mean)$")
    history_heads: int = Field(default=2, gt=0)
    history_layers: int = Field(default=1, ge=0)
    history_ff: int = Field(default=64, gt=0)
    # the shown item attends over the encoded history (one more interaction vector)
    target_attention: bool = True
    # the pairwise dots also go straight to the logit, one learned weight each (FM term)
    fm: bool = True
    # a DCN-v2 cross network (x_{l+1} = x_0 * (W x_l + b) + x_l) over every interaction
    # vector side by side, its output beside the dots into the top MLP: interactions of any
    # order between single coordinates, which dots of whole vectors do not reach. 0: none
    cross_layers: int = Field(default=0, ge=0)
    # the rank of each cross layer's W (U V^T, DCN-v2's low-rank form); None: full rank
    cross_rank: int | None = Field(default=None, gt=0)
    seed: int = 0
    # DLRMs of this shape (seeds seed, seed+1, ...) trained side by side, each on its own loss,
    # scored by their mean logit (`Ensemble`): lower NE for K times the training and scoring
    members: int = Field(default=1, ge=1, le=16)
    # with members > 1: a day of more training samples than this trains `members_beyond`
    # models. An average gains by the members' disagreement, which shrinks as the data
    # grows, while its cost grows with the data (docs/quality.md). None:
    # always `members`
    members_up_to_samples: int | None = Field(default=None, gt=0)
    members_beyond: int = Field(default=1, ge=1, le=16)

    def for_samples(self, samples: int) -> ModelConfig:
        """The shape a day of `samples` training samples trains: `members_beyond` models
        where the day is over `members_up_to_samples`."""
        if self.members_up_to_samples is None or samples <= self.members_up_to_samples:
            return self
        return self.model_copy(
            update={"members": self.members_beyond, "members_up_to_samples": None}
        )


class DedupConfig(_Strict):
    """Which features are deduplicated (dedup/unique.py, `plan_dedup`)."""

    min_factor: float = Field(default=2.0, ge=1.0)
    # how unique rows are found: `session` (one unique row per session run: exact for data
    # whose ingest checked user-side values constant within sessions; O(rows)), `runs`
    # (adjacent identical rows, compared value by value), `hash` (all duplicates in any
    # order: hash, then an exact check); `auto` = session where the data is checked, else runs
    method: Literal["auto", "session", "runs", "hash"] = "auto"
    profile_batches: int = Field(default=16, gt=0)  # batches the dedup profile is measured on
    groups: dict[str, list[str]] | None = None  # explicit groups: skip the measurement


Sharding = Literal["none", "auto", "table_wise", "row_wise", "column_wise", "flexshard"]


class FlexShardConfig(_Strict):
    """`train.sharding: flexshard` (modeling/sharded/flexshard.py): the hottest rows copied
    where their lookups pay for their gradients' sync, the rest sharded row by row."""

    # the rows a process may hold of a table, over the row-wise plan's ceil(rows / N): the
    # slack pays for the copies
    budget: float = Field(default=1.25, ge=1.0, le=64.0)
    # processes a node (the topology's tiers: a warm row is copied once a node, so its
    # lookups stay inside the node); None: all the run's processes on one node
    per_node: int | None = Field(default=None, ge=1)
    # BagPipe's oracle cache on these tables (modeling/sharded/bagpipe_tables.py): each
    # process keeps the remote rows its next `cache_lookahead` steps read (0: no cache), at
    # most `cache_budget` times the row-wise plan's rows
    cache_lookahead: int = Field(default=0, ge=0, le=64)
    cache_budget: float = Field(default=0.25, gt=0.0, le=64.0)
    # the oracle and the fetches of the next step in the background while a step computes
    # (BagPipe's prefetch); false: both at the step's start, on its critical path
    cache_background: bool = True


class TrainConfig(_Strict):
    """`recd train` (modeling/train.py)."""

    mode: Literal["dedup", "baseline"] = "dedup"
    batch_size: int = Field(default=4096, gt=0)
    # at most this many passes over the day; validation stops earlier and keeps the best
    # state. CTR models overfit after about one pass (the "one-epoch phenomenon") unless
    # the tables restart each pass (`restart_tables`); with restarts a day trained from
    # scratch gains for several passes, and a warm-started day stops after its best pass
    # and `pass_patience` more
    epochs: int = Field(default=7, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    # the longest a day's training may run before its orchestrator stops it and retries
    # (Airflow's execution_timeout on the train task): a hung step, not a slow day
    timeout_minutes: int = Field(default=180, gt=0)
    # each pass after the first starts the embedding tables (and their Adagrad state) again
    # from where the run started and keeps the dense layers (why: modeling/early_stopping.py).
    # Off for small tables that need many passes (MovieLens' ids)
    restart_tables: bool = True
    # with `restart_tables`: each pass after the first multiplies the dense layers' learning
    # rate by this (1: constant): later passes refine layers that already fit the day's
    # one-pass tables, where at a constant rate they wander
    lr_dense_pass_decay: float = Field(default=0.7, gt=0, le=1)
    validations_per_epoch: int = Field(default=4, gt=0)
    # each validation scores (and early stopping keeps) the mean of the weights at the
    # last this many validations, not the live weights (1): where the weights move more
    # between validations than the states being chosen differ, the mean is steadier, so
    # the state kept depends less on the seed (why: modeling/early_stopping.py). Costs a
    # copy of the model per validation in the window, in memory and in checkpoints
    average_states: int = Field(default=1, gt=0, le=16)
    # without `restart_tables`: stop after this many validations in a row without a better
    # validation NE (the best state is about the end of the first pass; two more
    # validations, half of a second pass, confirm it)
    patience: int = Field(default=2, gt=0)
    # with `restart_tables`: stop after this many passes in a row without a better
    # validation NE. Two, because one pass's tables are one draw: a pass worse than the one
    # before it is often followed by a better one
    pass_patience: int = Field(default=2, gt=0)
    # the auxiliary loss that predicts each user-side list's ids from the rest of the list
    # (modeling/cooccurrence.py), added to the click loss with this weight (0: off), with
    # this many sampled negatives: it teaches the tables what ids go together, which helps
    # where users carry several topical lists and hurts where the one list is the history
    # (MovieLens turns it off)
    cooccurrence_weight: float = Field(default=3.0, ge=0)
    cooccurrence_negatives: int = Field(default=1024, gt=0)
    # after training, fit a slope and an offset of the logit on the validation slice (the
    # day's latest rows, never trained on) so the scores follow the latest click rate
    # (modeling/calibration.py); off: the model's raw scores
    calibrate: bool = True
    # then the tables take one pass over the validation slice (dense layers and calibration
    # stay): the day's latest rows, which they would otherwise never see (modeling/train.py)
    fold_in_validation: bool = True
    lr_dense: float = Field(default=3e-3, gt=0)
    # the dense layers' learning rate when training starts from a saved model (a warm start,
    # the daily retrain): layers that already fit take smaller steps, as fine-tuning does.
    # None: lr_dense
    lr_dense_warm: float | None = Field(default=3e-4, gt=0)
    # embedding tables: row-wise Adagrad (modeling/optim.py); its per-row accumulator starts here
    lr_sparse: float = Field(default=0.1, gt=0)
    adagrad_initial_accumulator: float = Field(default=0.0, ge=0)
    # pipelines (`recd run`, the DAGs) start from the champion's weights when its feature
    # set and model config match; `recd train --init-from` names a model explicitly
    warm_start: bool = True
    # train on the last N days' batches (day D and the N-1 before it), oldest first: for a
    # model trained from scratch on a window. With a warm start from yesterday's model keep
    # 1, or the tables see yesterday twice
    window_days: int = Field(default=1, gt=0, le=31)
    checkpoint_every: int = Field(default=50, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    amp: bool = False  # bf16 autocast on CUDA
    # training processes (gloo on CPU, nccl on CUDA: one GPU each): data parallel, or with
    # `sharding` model parallel tables (`--nproc` on the command)
    nproc: int = Field(default=1, ge=1)
    # where the processes run: "local" on this machine (spawned; or each machine's torchrun
    # of one run across several); "ray" as Ray Train workers spread over the Ray cluster's
    # nodes (the cluster at `RAY_ADDRESS`, else a local instance), each resuming from the
    # run's checkpoint when Ray restarts them after one dies (modeling/ray_engine.py)
    engine: Literal["local", "ray"] = "local"
    # engine ray: how often Ray restarts the workers after one of them dies
    max_failures: int = Field(default=2, ge=0)
    # with several processes: "none" replicates every table in every process (data
    # parallel); otherwise the tables are sharded across the processes through TorchRec
    # (modeling/sharded/), placed by its planner (`auto`) or table-, row- or column-wise,
    # or per row by FlexShard (`flexshard`: hot rows copied, the rest row by row), and each
    # process takes a slice of every batch
    sharding: Sharding = "none"
    flexshard: FlexShardConfig = FlexShardConfig()
    # with `sharding`: the memory a process may give its shards of the tables (MB), every
    # copy the run keeps (live, early stopping's best state, the passes' restart point);
    # the planner places them within it or training refuses. None: the device's memory
    memory_budget_mb: int | None = Field(default=None, gt=0)
    # how the trained model is saved: "single" one model.pt (every reader loads it whole);
    # "shards" the tables as shard files, each rank writing its own (readers map the rows
    # they need: modeling/shard_files.py); "auto" shards when a sharded run's tables and
    # their accumulators exceed `memory_budget_mb`, so no process could hold them gathered
    saved_layout: Literal["auto", "single", "shards"] = "auto"
    # torch intra-op threads on CPU; None: the CPUs the process may use (affinity, cgroup
    # quota: recd_core/runtime.py) shared among the run's processes
    threads: int | None = Field(default=None, gt=0)
    dedup: DedupConfig = DedupConfig()
    model: ModelConfig = ModelConfig()


class TransformSpec(_Strict):
    """How DPP turns one raw feature into a model input (applied in this order).

    ids:    `hash` (stable 64-bit mix, then mod table size; False: plain mod; None: the
            feature's own `hash`), `truncate` (id lists keep their first N ids, sequences
            their last N)
    dense:  `default` for nulls, `log1p` (of max(x, 0)), `clip` to [low, high],
            `standardize` with mean/std of the training partition (saved with the batches),
            `buckets`: boundaries that turn the values into ids (the feature becomes an id
            list of `dim` ids, one per dimension)
    """

    hash: bool | None = None
    truncate: int | None = Field(default=None, gt=0)
    default: float | None = None
    log1p: bool = False
    clip: tuple[float, float] | None = None
    standardize: bool = False
    buckets: list[float] | None = None

    def hash_for(self, spec: FeatureSpec) -> bool:
        """Whether `spec`'s ids are hashed: this transform's `hash`, else the feature's."""
        return spec.hash if self.hash is None else self.hash

    @model_validator(mode="after")
    def _ordered(self) -> TransformSpec:
        if self.clip is not None and self.clip[0] > self.clip[1]:
            raise ValueError("clip: low must not exceed high")
        if self.buckets is not None and (not self.buckets or sorted(self.buckets) != self.buckets):
            raise ValueError("buckets must be a non-empty increasing list")
        return self


class PreprocessConfig(_Strict):
    """`recd preprocess` (dpp/preprocess.py)."""

    mode: Literal["dedup", "baseline"] = "dedup"
    batch_size: int = Field(default=4096, gt=0)
    # a day too small for this many training steps a pass at `batch_size` is cut into
    # smaller batches: `batch_size` halved (not below 256) until a pass has that many, so
    # the batch grows with the data and a small day still gets the steps it learns from
    # (MovieLens at 500: ml-100k 256, ml-1m 1024; docs/benchmarks.md). Training asks for
    # `batch_size` and takes the batches' size. None: always `batch_size`
    min_steps_per_pass: int | None = Field(default=None, gt=0)
    batches_per_split: int = Field(default=8, gt=0)  # a split = the unit of parallel work
    workers: int = Field(default=1, gt=0)
    engine: Literal["local", "ray"] = "local"
    # local workers as processes (isolation; ~1 s start-up each) or threads (Arrow decoding
    # and numpy release the GIL; no start-up: better on small machines and short jobs)
    executor: Literal["process", "thread"] = "process"
    compression: Literal["lz4", "zstd", "none"] = "lz4"
    # the day's latest rows by time (this share of them) become validation batches that
    # training evaluates on and never trains on (early stopping); 0 = no validation
    validation_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    # `time`: the day's latest rows (a daily log); `user`: each user's latest rows (a table
    # whose users span the whole period, e.g. MovieLens split by time per user)
    validation_by: Literal["time", "user"] = "time"
    transforms: dict[str, TransformSpec] = {}
    default_dense: TransformSpec = TransformSpec(standardize=True)
    dedup: DedupConfig = DedupConfig()

    def transform_for(self, spec: FeatureSpec) -> TransformSpec:
        """The feature's transform, its `hash` resolved (the feature's own where unset)."""
        if spec.name in self.transforms:
            t = self.transforms[spec.name]
        else:
            t = self.default_dense if spec.kind == "dense" else TransformSpec()
        return t if t.hash is not None else t.model_copy(update={"hash": t.hash_for(spec)})


class RegistryConfig(_Strict):
    """How trained models are registered and judged (mlops/versions.py, mlops/registry.py, mlops/compare.py)."""

    model_name: str = Field(default="recd-dlrm", min_length=1)
    # a challenger is promoted when its NE on the evaluation day is at most the champion's + this
    ne_tolerance: float = Field(default=0.0, ge=0)
    # `recd compare` fails when the arms' NE or AUC differ by more than these
    compare_ne_tolerance: float = Field(default=0.01, ge=0)
    compare_auc_tolerance: float = Field(default=0.01, ge=0)
    eval_batch_size: int = Field(default=4096, gt=0)


class ServeConfig(_Strict):
    """The scoring server's limits (`recd serve`, serving/app.py): what one request may hold
    and how much the server takes on at once, so its memory stays bounded whatever arrives."""

    max_rows: int = Field(default=10_000, gt=0, description="rows in one request; more is a 413")
    max_bytes: int = Field(default=64 << 20, gt=0, description="bytes of a body; more is a 413")
    batch_rows: int = Field(default=1024, gt=0, description="rows a model call scores at most")
    queue_rows: int | None = Field(
        default=None,
        gt=0,
        description="rows (candidates) held at once, checked and waiting or being scored; past "
        "it a 503 (retry); none: 8 batches of batch_rows, at least max_rows",
    )
    max_in_flight: int | None = Field(
        default=None,
        gt=0,
        description="requests held at once (being read, checked, waiting or scored); more are "
        "answered 503 (retry); none: from the row budget, queue_rows / 16, at least 4",
    )
    batch_wait_ms: float = Field(
        default=0.0,
        ge=0,
        description="how long a model call waits for more ranking requests to score with it "
        "(0: only those that arrived while the one before was scored)",
    )
    timeout_s: float = Field(default=60.0, gt=0, description="seconds a request may take, or 504")
    dedup: bool = Field(
        default=True,
        description="a ranking request's user side computed once (false: once a candidate)",
    )
    threads: int | None = Field(
        default=None,
        gt=0,
        description="torch's threads for a model call; none: the CPU budget (affinity, cgroup "
        "quota) less the two that read and check requests, at least 1",
    )
    follow_alias_s: float = Field(
        default=0.0,
        ge=0,
        description="seconds between checks of a models:/NAME@ALIAS model's alias; a version "
        "it moves to is loaded, checked and swapped in (0: loaded once)",
    )

    @property
    def rows_held(self) -> int:  # `queue_rows`, or 8 model calls' rows (a largest request)
        return self.queue_rows or max(8 * self.batch_rows, self.max_rows)

    @property
    def requests_held(self) -> int:  # or from the rows: requests of 16 rows fill the queue
        return self.max_in_flight or max(4, self.rows_held // 16)


class PipelineConfig(_Strict):
    """Everything one pipeline run needs; loadable from one YAML file."""

    features: FeatureSet
    synth: SynthConfig = SynthConfig(**SYNTH_PRESETS["default"])
    ingest: IngestConfig = IngestConfig()
    generate: GenerateConfig = GenerateConfig()
    # a daily retrain: batches of 512 (the passes: `TrainConfig.epochs`; validation decides)
    preprocess: PreprocessConfig = PreprocessConfig(batch_size=512)
    train: TrainConfig = TrainConfig(batch_size=512)
    registry: RegistryConfig = RegistryConfig()
    serve: ServeConfig = ServeConfig()
