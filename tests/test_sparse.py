"""KJT / IKJT: layouts, exact conversions both ways, construction from Arrow, bad input."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recd_core.dedup.sparse as sparse
import recd_core.dedup.unique as dedup
from recd_core.dedup.sparse import (
    InverseKeyedJaggedTensor,
    JaggedError,
    KeyedJaggedTensor,
    ikjt_from_arrow,
    kjt_from_arrow,
    unique_rows,
)


def test_kjt_layout_and_views():
    kjt = KeyedJaggedTensor(
        ["f1", "f2"], torch.tensor([1, 2, 3, 7, 7, 8, 9]), torch.tensor([2, 0, 1, 1, 1, 2])
    )
    assert kjt.offsets.tolist() == [0, 2, 2, 3, 4, 5, 7]
    assert kjt.batch_size == 3
    assert kjt["f1"].to_list() == [[1, 2], [], [3]]
    assert kjt["f2"].to_list() == [[7], [7], [8, 9]]
    assert kjt.length_per_key().tolist() == [3, 4]
    assert kjt.to("cpu").equals(kjt)


def test_ikjt_docstring_example():
    t = pa.table({"f1": [[1, 2], [3], [1, 2], [3]], "f2": [[7], [8], [7], [8, 9]]})
    ik = ikjt_from_arrow(t, ["f1", "f2"])
    assert ik.inverse_indices.tolist() == [0, 1, 0, 2]
    assert ik.unique["f1"].to_list() == [[1, 2], [3], [3]]
    assert ik.unique["f2"].to_list() == [[7], [8], [8, 9]]
    assert ik.to_kjt().equals(kjt_from_arrow(t, ["f1", "f2"]))


rows = st.lists(st.lists(st.integers(0, 5), max_size=4), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None)
@given(rows, rows, st.data())
def test_dedup_then_expand_is_exact(a, b, data):
    n = min(len(a), len(b))
    # make duplicates likely: draw rows from a small pool
    pick = data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
    t = pa.table(
        {
            "a": pa.array([a[i] for i in pick], pa.list_(pa.int64())),
            "b": pa.array([b[i] for i in pick], pa.list_(pa.int64())),
            "s": pa.array(pick, pa.int64()),
        }
    )
    keys = ["a", "b", "s"]
    kjt = kjt_from_arrow(t, keys)
    ik = ikjt_from_arrow(t, keys)
    assert ik.to_kjt().equals(kjt)
    assert ik.num_unique == len({(tuple(a[i]), tuple(b[i]), i) for i in pick})
    assert InverseKeyedJaggedTensor.from_kjt(kjt).to_kjt().equals(kjt)
    # unique rows are in order of first appearance
    firsts = ik.inverse_indices.tolist()
    assert firsts[0] == 0 and all(
        x <= max(firsts[:i], default=-1) + 1 for i, x in enumerate(firsts)
    )


def test_hash_collisions_fall_back_to_exact_comparison(monkeypatch):
    monkeypatch.setattr(
        dedup, "_row_hash", lambda v, ln: np.zeros(ln.size, np.uint64)
    )  # every row collides
    vals = [np.array([1, 2, 3, 1, 2], np.int64)]
    lens = [np.array([2, 1, 2, 0], np.int64)]
    first, inverse = unique_rows(vals, lens)
    assert first.tolist() == [0, 1, 3] and inverse.tolist() == [0, 1, 0, 2]


@pytest.mark.parametrize(
    "values, lengths, problem",
    [
        ([1, 2, 3], [1, 1], "lengths sum to 2 but there are 3 values"),
        ([1, 2], [1, 1, 0], "do not split evenly"),
        ([1, 2], [3, -1], "negative length"),
    ],
)
def test_inconsistent_kjt_is_a_clear_error(values, lengths, problem):
    with pytest.raises(JaggedError, match=problem):
        KeyedJaggedTensor(["a", "b"], torch.tensor(values), torch.tensor(lengths))


def test_inverse_index_past_the_unique_rows_is_an_error():
    uniq = KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(
        JaggedError,
        match=r"inverse index out of range: values in \[0, 2\] but there are 2 unique rows",
    ):
        InverseKeyedJaggedTensor(uniq, torch.tensor([0, 1, 2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_pin_and_move_to_cuda():
    t = pa.table({"a": [[1], [1], [2]]})
    ik = ikjt_from_arrow(t, ["a"]).pin_memory().to("cuda", non_blocking=True)
    assert ik.inverse_indices.is_cuda and ik.to_kjt().to("cpu").equals(kjt_from_arrow(t, ["a"]))


def test_torchrec_variable_batch_conversion():
    pytest.importorskip("torchrec", reason="the torchrec extra is not installed")
    t = pa.table({"a": [[1, 2], [1, 2], [3]], "b": [[5], [5], [6]]})
    ik = ikjt_from_arrow(t, ["a", "b"])
    trec = sparse.to_torchrec(ik)
    assert trec.keys() == ["a", "b"]
    assert trec.stride_per_key() == [2, 2]
    assert trec.inverse_indices()[1].tolist() == [[0, 0, 1], [0, 0, 1]]
    assert torch.equal(
        sparse.to_torchrec(kjt_from_arrow(t, ["a"])).values(), torch.tensor([1, 2, 1, 2, 3])
    )
