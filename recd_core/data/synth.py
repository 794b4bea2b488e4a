"""`recd synth`: raw impression logs with the structure RecD exploits.

Users open sessions; a session shows several items (heavy-tailed count, mean
`mean_session_length`, capped). User-side features are snapshotted at session start, so
every impression of a session repeats them; the user history is the user's recent clicks,
so it changes between sessions of the same user.

Clicks are learnable from the features, as in real logs: users and items belong to one of
`topics` topics; a user's id lists and an item's categoricals lean towards their topic's
share of the id space, a fraction of impressions is targeted at the user's topic, and a
topic match raises the click probability. On top come a latent user-item affinity (carried
by the dense features), user and item biases, a position effect and Bernoulli noise.

The generator is generic over a `FeatureSet` by (side, kind):

  user  sparse    user key = the session's user; others a per-user categorical
  user  id_list   a per-user list (lengths from `synth_length`)
  user  sequence  the user's last clicked items before the session (most recent last)
  user  dense     per-user floats; the leading dims carry the user's latent vector
  item  sparse    item key = the shown item (Zipf popularity); others per-item categoricals
  item  id_list   a per-item list;   item dense: per-item floats carrying its latent vector
  context         `position` (rank in the session), `hour` (of the impression); others random

Output: `OUT/ds=YYYY-MM-DD/events-NNNNN.jsonl.gz`, one JSON object per line (docs/events.md).
The same (config, seed) always yields the same bytes.

The workload's optimum: every label is drawn from a known click probability, so the best
any model can do on a day is to predict exactly those. `OUT/ds=D/_oracle.json` holds that
oracle's NE, AUC and log loss on the day's labels (ingest skips `_` files); `recd run` and
the evaluate stage show it next to a model's next-day NE, so the gap to the optimum is in
the record.
"""

from __future__ import annotations

import datetime as dt
import functools
import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recd_core import metrics
from recd_core.config import ConfigError, FeatureSet, FeatureSpec, SynthConfig
from recd_core.data.logs_root import ORACLE_FILE, logs_for_day, mark_complete

ROWS_PER_FILE = 50_000
HISTORY_SIDE_KINDS = {("user", "sequence")}


@dataclass(frozen=True)
class Ragged:
    """Per-entity variable-length lists: entity i owns values[offsets[i]:offsets[i+1]]."""

    offsets: np.ndarray
    values: np.ndarray

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]


TOPIC_LEAN = 0.6  # share of a list's ids (or of categoricals) drawn from the owner's topic
DENSE_SIGNAL, DENSE_NOISE = 0.7, 0.3  # a dense feature's latent dims: 0.7 latent + 0.3 noise
_SCATTER, _SHIFT = 2_654_435_761, 97  # a skewed id's rank, scattered over the table


def _skewed_ids(rng: np.random.Generator, table_size: int, n: int) -> np.ndarray:
    """Ids in [0, table_size) with a heavy head (a few popular values), scattered over the table."""
    ranks = np.minimum((table_size * rng.random(n) ** 2).astype(np.int64), table_size - 1)
    return (ranks * _SCATTER + _SHIFT) % table_size


def skewed_id_probabilities(table_size: int) -> np.ndarray:
    """P(id) of `_skewed_ids`: rank r = floor(size * U^2) has probability
    sqrt((r + 1) / size) - sqrt(r / size)."""
    ranks = np.arange(table_size, dtype=np.float64)
    p = np.sqrt((ranks + 1) / table_size) - np.sqrt(ranks / table_size)
    out = np.zeros(table_size)
    np.add.at(out, (np.arange(table_size, dtype=np.int64) * _SCATTER + _SHIFT) % table_size, p)
    return out


def _topical_ids(
    rng: np.random.Generator, table_size: int, topics: np.ndarray, n_topics: int
) -> np.ndarray:
    """One id per entry: from the entry's topic's slice of the table with probability
    TOPIC_LEAN, else anywhere (skewed)."""
    ids = _skewed_ids(rng, table_size, topics.size)
    width = table_size // n_topics
    if width >= 1:
        lean = rng.random(topics.size) < TOPIC_LEAN
        ids = np.where(lean, topics * width + rng.integers(0, width, size=topics.size), ids)
    return ids


def _ragged(
    rng: np.random.Generator, spec: FeatureSpec, topics: np.ndarray, n_topics: int
) -> Ragged:
    lo, hi = spec.synth_length or (1, min(spec.max_length or 8, 8))
    lengths = rng.integers(lo, hi + 1, size=topics.size)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Ragged(
        offsets, _topical_ids(rng, spec.table_size or 1, np.repeat(topics, lengths), n_topics)
    )


def _dense(rng: np.random.Generator, dim: int, latent: np.ndarray) -> np.ndarray:
    out = rng.normal(0.0, 1.0, size=(latent.shape[0], dim)).astype(np.float32)
    k = min(dim, latent.shape[1])
    out[:, :k] = DENSE_SIGNAL * latent[:, :k] + DENSE_NOISE * out[:, :k]
    return np.round(out, 4)


def _session_length_sampler(
    mean: float, cap: int
) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Heavy-tailed (log-normal, sigma 1) session lengths in [1, cap] whose mean is `mean`."""
    z = np.random.default_rng(12345).standard_normal(50_000)

    def lengths(mu: float, zz: np.ndarray) -> np.ndarray:
        return np.clip(np.ceil(np.exp(mu + zz)), 1, cap).astype(np.int64)

    lo, hi = -5.0, np.log(cap) + 5
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if lengths(mid, z).mean() < mean else (lo, mid)
    mu = (lo + hi) / 2
    return lambda rng, n: lengths(mu, rng.standard_normal(n))


def _check_index_ranges(features: FeatureSet, cfg: SynthConfig) -> None:
    """An unhashed feature's ids are row indices (`FeatureSpec.hash`): the largest id the
    generator draws for it must fit its table (list ids and categoricals always do)."""
    largest = {
        features.user_key: cfg.users - 1,
        features.item_key: cfg.items - 1,
        "position": cfg.max_session_length - 1,
        "hour": 23,
    }
    largest |= {s.name: cfg.items - 1 for s in features.features if s.kind == "sequence"}
    for s in features.features:
        top = largest.get(s.name)
        if top is not None and not s.hash and top >= (s.table_size or 0):
            raise ConfigError(
                f"synth: feature {s.name!r} draws ids up to {top}, beyond its table_size "
                f"{s.table_size} (hash: false, its ids are row indices): raise table_size "
                "or let DPP hash them"
            )


class World:
    """Users and items with their latent factors and static features (fixed per seed)."""

    def __init__(self, features: FeatureSet, cfg: SynthConfig):
        _check_index_ranges(features, cfg)
        rng = np.random.default_rng([cfg.seed, 0])
        self.features, self.cfg = features, cfg
        d = cfg.latent_dim
        self.user_latent = rng.normal(size=(cfg.users, d)).astype(np.float32)
        self.item_latent = rng.normal(size=(cfg.items, d)).astype(np.float32)
        self.user_bias = rng.normal(0, 0.5, cfg.users)
        self.item_bias = rng.normal(0, 0.5, cfg.items)
        self.user_topic = rng.integers(0, cfg.topics, size=cfg.users)
        self.item_topic = rng.integers(0, cfg.topics, size=cfg.items)
        self.activity = rng.lognormal(0.0, 1.0, cfg.users)
        self.activity /= self.activity.sum()
        ranks = np.arange(1, cfg.items + 1, dtype=np.float64)
        pop = ranks**-cfg.item_zipf
        self.item_popularity = np.empty_like(pop)
        self.item_popularity[rng.permutation(cfg.items)] = pop / pop.sum()
        # per topic: its items and their popularity, for targeted impressions
        self.topic_items = [np.flatnonzero(self.item_topic == t) for t in range(cfg.topics)]
        self.topic_popularity = [
            self.item_popularity[ix] / self.item_popularity[ix].sum() for ix in self.topic_items
        ]
        self.user_static: dict[str, np.ndarray | Ragged] = {}
        self.item_static: dict[str, np.ndarray | Ragged] = {}
        for spec in features.features:
            if spec.side == "user" and spec.name != features.user_key:
                self.user_static[spec.name] = self._static(
                    rng, spec, self.user_topic, self.user_latent
                )
            elif spec.side == "item" and spec.name != features.item_key:
                if spec.kind == "sequence":
                    raise ConfigError(
                        f"synth: item-side sequence feature {spec.name!r} is not supported"
                    )
                self.item_static[spec.name] = self._static(
                    rng, spec, self.item_topic, self.item_latent
                )
        seq = [s for s in features.by_side("user") if s.kind == "sequence"]
        self.history_len = (seq[0].synth_length or (16, seq[0].max_length))[1] if seq else 0
        # Day-zero histories: items shown to the user as in `sample_items`.
        self.history: list[list[int]] = []
        if seq:
            lo, hi = seq[0].synth_length or (16, seq[0].max_length)
            n = rng.integers(lo, hi + 1, size=cfg.users)
            flat = self.sample_items(rng, np.repeat(np.arange(cfg.users), n))
            self.history = [a.tolist() for a in np.split(flat, np.cumsum(n)[:-1])]

    def _static(
        self, rng, spec: FeatureSpec, topics: np.ndarray, latent: np.ndarray
    ) -> np.ndarray | Ragged:
        if spec.kind == "sparse":
            return _topical_ids(rng, spec.table_size or 1, topics, self.cfg.topics)
        if spec.kind == "dense":
            return _dense(rng, spec.dim, latent)
        return _ragged(rng, spec, topics, self.cfg.topics)

    def sample_items(self, rng: np.random.Generator, users: np.ndarray) -> np.ndarray:
        """One shown item per impression: popular items, a share targeted at the user's topic."""
        items = rng.choice(self.cfg.items, size=users.size, p=self.item_popularity)
        targeted = rng.random(users.size) < self.cfg.targeted_share
        topics = self.user_topic[users]
        for t, pool in enumerate(self.topic_items):
            rows = np.flatnonzero(targeted & (topics == t))
            if rows.size and pool.size:
                items[rows] = rng.choice(pool, size=rows.size, p=self.topic_popularity[t])
        return items


def _json_value(spec: FeatureSpec, value) -> str:
    if isinstance(value, np.ndarray):
        return json.dumps(value.tolist(), separators=(",", ":"))
    if spec.kind == "dense":
        return json.dumps(float(value))
    return str(int(value))


def _static_fragment(spec: FeatureSpec, table: np.ndarray | Ragged, i: int) -> str:
    if isinstance(table, Ragged):
        v = table.row(i)
    else:
        v = table[i]
        if spec.kind == "dense" and spec.dim == 1:
            v = v[0]
    return f'"{spec.name}":{_json_value(spec, v)}'


def _fragments(key: str, tables: dict, specs: list[FeatureSpec]) -> Callable[[int], str]:
    """The JSON fragment of one entity's static features, built once per entity."""

    @functools.cache
    def fragment(i: int) -> str:
        return ",".join([f'"{key}":{i}', *(_static_fragment(s, tables[s.name], i) for s in specs)])

    return fragment


IDS_PER_DAY = 10**8  # event and session ids of a day start at ordinal * this


@dataclass(frozen=True)
class Day:
    """One synthesized day: its JSON lines, produced lazily in files' worth (`chunks`: lists
    of `ROWS_PER_FILE` lines, the last one shorter; memory stays one file's text whatever
    the day's size), its row and session counts, the labels and the true click
    probabilities the labels were drawn from, and each impression's user, item and position
    (what `logit_parts` needs). Consume `chunks` before the next day: it advances the users'
    click histories."""

    chunks: Iterator[list[str]]
    rows: int
    sessions: int
    labels: np.ndarray
    click_prob: np.ndarray
    users: np.ndarray
    items: np.ndarray
    position: np.ndarray


def click_logit(cfg: SynthConfig, topic_match, affinity, user_bias, item_bias, position):
    """The generator's click model: the true logit of each impression from its terms."""
    return (
        cfg.base_ctr_logit
        + cfg.topic_effect * topic_match
        + 1.0 * affinity
        + user_bias
        + item_bias
        - 0.02 * position
    )


def seen_latent_dims(world: World) -> int:
    """How many leading latent dimensions both sides' dense features carry (0 where a side
    has none): the affinity a model can learn from the dense features alone."""
    dense = {
        s.side: min(s.dim, world.cfg.latent_dim)
        for s in world.features.features
        if s.kind == "dense"
    }
    return min(dense.get("user", 0), dense.get("item", 0))


def logit_parts(world: World, day: Day) -> dict[str, np.ndarray]:
    """The terms of each impression's true click logit, apart from the base rate: the topic
    match, the latent affinity split into the dimensions both sides' dense features carry
    (`affinity_seen`) and the ones only ids can teach (`affinity_ids`), the two biases and
    the position: `click_logit` of them is the oracle's logit."""
    seen = seen_latent_dims(world)
    u, i = world.user_latent[day.users], world.item_latent[day.items]
    scale = np.sqrt(world.cfg.latent_dim)
    return {
        "topic_match": (world.user_topic[day.users] == world.item_topic[day.items]).astype(float),
        "affinity_seen": (u[:, :seen] * i[:, :seen]).sum(1) / scale,
        "affinity_ids": (u[:, seen:] * i[:, seen:]).sum(1) / scale,
        "user_bias": world.user_bias[day.users],
        "item_bias": world.item_bias[day.items],
        "position": day.position.astype(float),
    }


def oracle_figures(labels: np.ndarray, click_prob: np.ndarray) -> dict[str, float]:
    """NE, AUC and log loss of the true click probabilities: the best a model can do."""
    return {
        "ne": metrics.normalized_entropy(labels, click_prob),
        "auc": metrics.auc(labels, click_prob),
        "logloss": metrics.logloss(labels, click_prob),
        "ctr": float(np.mean(labels)) if labels.size else float("nan"),
        "rows": int(labels.size),
    }


def generate_day(world: World, day: dt.date) -> Day:
    """One day's impression lines (as str), sessions, labels and true click probabilities.

    The day's randomness and ids derive from its date, not from its place in a run, so a day
    synthesized alone (the daily pipeline) equals the same day synthesized in a range."""
    cfg, fs = world.cfg, world.features
    rng = np.random.default_rng([cfg.seed, 1, day.toordinal()])
    first_event_id = first_session_id = day.toordinal() * IDS_PER_DAY
    sample_lengths = _session_length_sampler(cfg.mean_session_length, cfg.max_session_length)
    lengths = sample_lengths(rng, int(cfg.samples_per_day / cfg.mean_session_length * 1.5) + 16)
    n_sessions = int(np.searchsorted(np.cumsum(lengths), cfg.samples_per_day)) + 1
    lengths = lengths[:n_sessions]
    users = rng.choice(cfg.users, size=n_sessions, p=world.activity)
    day_start_ms = int(dt.datetime.combine(day, dt.time(), dt.UTC).timestamp() * 1000)
    starts = np.sort(rng.integers(0, 86_400_000 - 3_600_000, size=n_sessions))
    n = int(lengths.sum())
    session_of_row = np.repeat(np.arange(n_sessions), lengths)
    row_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    position = np.arange(n) - row_start
    gaps = rng.exponential(20_000.0, size=n).astype(np.int64)
    ts = day_start_ms + starts[session_of_row] + _within_session_offsets(gaps, lengths)
    user_of_row = users[session_of_row]
    items = world.sample_items(rng, user_of_row)
    topic_match = world.user_topic[user_of_row] == world.item_topic[items]
    affinity = (world.user_latent[user_of_row] * world.item_latent[items]).sum(1) / np.sqrt(
        cfg.latent_dim
    )
    logit = click_logit(
        cfg, topic_match, affinity, world.user_bias[user_of_row], world.item_bias[items], position
    )
    click_prob = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < click_prob).astype(np.int64)

    user_specs = [s for s in fs.by_side("user") if s.name != fs.user_key]
    static_user = [s for s in user_specs if (s.side, s.kind) not in HISTORY_SIDE_KINDS]
    history_spec = next((s for s in user_specs if s.kind == "sequence"), None)
    item_specs = [s for s in fs.by_side("item") if s.name != fs.item_key]
    context_specs = fs.by_side("context")
    context_cols = {}
    for s in context_specs:
        if s.name == "position":
            context_cols[s.name] = position
        elif s.name == "hour":
            context_cols[s.name] = (ts // 3_600_000) % 24
        elif s.kind == "sparse":
            context_cols[s.name] = rng.integers(0, s.table_size or 1, size=n)
        else:
            raise ConfigError(f"synth: context feature {s.name!r} must be sparse")

    user_fragment = _fragments(fs.user_key, world.user_static, static_user)
    item_fragment = _fragments(fs.item_key, world.item_static, item_specs)

    def chunks() -> Iterator[list[str]]:
        lines: list[str] = []
        ends = np.cumsum(lengths)
        for s in range(n_sessions):
            u, lo, hi = int(users[s]), int(ends[s] - lengths[s]), int(ends[s])
            head = user_fragment(u)
            if history_spec is not None:
                hist = world.history[u][-history_spec.max_length :]
                head += f',"{history_spec.name}":' + json.dumps(hist, separators=(",", ":"))
            sid = first_session_id + s
            for r in range(lo, hi):
                ctx = "".join(f',"{k}":{int(v[r])}' for k, v in context_cols.items())
                lines.append(
                    f'{{"event_id":{first_event_id + r},"ts":{int(ts[r])},"session_id":{sid},'
                    f'{head},{item_fragment(int(items[r]))}{ctx},"label":{int(labels[r])}}}'
                )
            if history_spec is not None:
                clicked = items[lo:hi][labels[lo:hi] == 1]
                if clicked.size:
                    world.history[u] = (world.history[u] + clicked.tolist())[-world.history_len :]
            if len(lines) >= ROWS_PER_FILE:
                yield lines[:ROWS_PER_FILE]
                lines = lines[ROWS_PER_FILE:]
        if lines:
            yield lines

    return Day(chunks(), n, n_sessions, labels, click_prob, user_of_row, items, position)


def _within_session_offsets(gaps: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Cumulative gaps restarting at 0 for the first impression of every session."""
    csum = np.cumsum(gaps)
    first = np.cumsum(lengths) - lengths
    base = np.repeat(csum[first], lengths)
    return csum - base


def synthesize(
    features: FeatureSet,
    cfg: SynthConfig,
    out_dir: str | Path,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, float]:
    """Write `cfg.days` days of logs under `out_dir/ds=YYYY-MM-DD/`; return the figures,
    the oracle's per day (`synth.oracle_ne.<day>`) and pooled over the days."""
    out = Path(out_dir)
    world = World(features, cfg)
    total_rows = total_bytes = total_sessions = 0
    oracle: dict[str, float] = {}
    all_labels, all_probs = [], []
    for k in range(cfg.days):
        day = cfg.start_date + dt.timedelta(days=k)
        generated = generate_day(world, day)
        total_sessions += generated.sessions
        part = out / f"ds={day.isoformat()}"
        part.mkdir(parents=True, exist_ok=True)
        for old in part.glob("events-*.jsonl.gz"):
            old.unlink()
        figures = oracle_figures(generated.labels, generated.click_prob)
        (part / ORACLE_FILE).write_text(json.dumps({"ds": day.isoformat(), **figures}, indent=1))
        oracle[f"synth.oracle_ne.{day}"] = figures["ne"]
        oracle[f"synth.oracle_auc.{day}"] = figures["auc"]
        all_labels.append(generated.labels)
        all_probs.append(generated.click_prob)
        for f, lines in enumerate(generated.chunks):
            path = part / f"events-{f:05d}.jsonl.gz"
            data = ("\n".join(lines) + "\n").encode("utf-8")
            # mtime=0: the same seed gives the same bytes.
            path.write_bytes(gzip.compress(data, compresslevel=1, mtime=0))
            total_bytes += path.stat().st_size
            if progress:
                progress(f"{day} file {f + 1}", len(lines))
        total_rows += generated.rows
        if progress:
            progress(f"{day} {generated.rows} impressions in {generated.sessions} sessions", 0)
    return {
        "synth.rows": total_rows,
        "synth.days": cfg.days,
        "synth.sessions": total_sessions,
        "synth.bytes_gz": total_bytes,
        "synth.mean_session_length": total_rows / max(total_sessions, 1),
        **_pooled_oracle(all_labels, all_probs),
        **oracle,
    }


def _pooled_oracle(labels: list[np.ndarray], probs: list[np.ndarray]) -> dict[str, float]:
    if not labels:
        return {}
    pooled = oracle_figures(np.concatenate(labels), np.concatenate(probs))
    return {"synth.oracle_ne": pooled["ne"], "synth.oracle_auc": pooled["auc"]}


def synthesize_missing(
    logs: str | Path,
    days: list[str],
    features: FeatureSet,
    cfg: SynthConfig,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """Synthesize the days that have no logs yet (a day with logs is kept: delete it to
    synthesize it anew); consecutive missing days in one run, so the users' click histories
    carry over from one day to the next. The summary: `synthesize`'s, summed over the runs
    (the pooled oracle only when the days were one run)."""
    missing = sorted(
        d
        for d in set(days)
        if not (logs_for_day(logs, d).is_dir() and any(logs_for_day(logs, d).iterdir()))
    )
    runs: list[list[dt.date]] = []
    for d in map(dt.date.fromisoformat, missing):
        if runs and (d - runs[-1][-1]).days == 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    out: dict = {
        "synth.days": len(missing),
        "synth.rows": 0,
        "synth.kept": len(set(days)) - len(missing),
    }
    for run in runs:
        one = cfg.model_copy(update={"start_date": run[0], "days": len(run)})
        summary = synthesize(features, one, Path(logs), progress)
        for k, v in summary.items():
            if k in ("synth.rows", "synth.sessions", "synth.bytes_gz"):
                out[k] = out.get(k, 0) + v
            elif k.startswith(("synth.oracle_ne.", "synth.oracle_auc.")) or len(runs) == 1:
                out.setdefault(k, v)
    if out.get("synth.sessions"):
        out["synth.mean_session_length"] = out["synth.rows"] / out["synth.sessions"]
    for d in days:  # the producer of these days: they are complete (a waiting run goes on)
        mark_complete(logs, d)
    return out
