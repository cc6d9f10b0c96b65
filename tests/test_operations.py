"""Single-process tests of the operations on nested structures (multi-rank ones: tests/multiproc/)."""

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.utils import operations as ops
from accel.utils.operations import (
    TensorInformation,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    get_data_structure,
    initialize_tensors,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)

Pair = collections.namedtuple("Pair", "first second")


def nested():
    return {
        "ids": torch.arange(6).view(3, 2),
        "rest": [torch.ones(3), Pair(torch.zeros(3, 1, dtype=torch.float64), "label")],
        "note": "text",
        "count": 7,
    }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_recursively_apply_keeps_containers_and_non_tensors():
    out = recursively_apply(lambda t: t + 1, nested())
    assert isinstance(out["rest"][1], Pair) and out["rest"][1].second == "label"
    assert torch.equal(out["ids"], torch.arange(1, 7).view(3, 2))
    assert out["note"] == "text" and out["count"] == 7


def test_recursively_apply_can_reject_other_types():
    with pytest.raises(TypeError, match="Unsupported type str"):
        recursively_apply(lambda t: t, {"a": torch.ones(1), "b": "x"}, error_on_other_type=True)


def test_single_process_collectives_are_identities():
    data = nested()
    assert_same(gather(data), data)
    assert_same(pad_across_processes(data), data)
    assert_same(reduce(data, "sum"), data)
    assert gather_object([1, 2]) == [1, 2] and gather_object("a") == ["a"]
    assert ops.broadcast(data) is data
    objs = [1, "two"]
    assert ops.broadcast_object_list(objs) == [1, "two"]


def test_reduce_returns_new_tensors_scaled():
    data = {"a": torch.ones(2), "b": [torch.full((1,), 4.0)]}
    out = reduce(data, "mean", scale=0.5)
    assert torch.equal(out["a"], torch.full((2,), 0.5)) and torch.equal(out["b"][0], torch.full((1,), 2.0))
    out["a"].add_(1)
    assert torch.equal(data["a"], torch.ones(2))


def test_reduce_rejects_unknown_reduction():
    with pytest.raises(ValueError, match="'max'.*use 'sum', 'mean' or 'none'"):
        reduce(torch.ones(1), "max")


def test_send_to_device_moves_tensors_and_skips_keys():
    class Movable:
        def to(self, device, non_blocking=False):
            self.moved_to = device
            return self

    t = torch.ones(2)
    data = {"a": t, "b": [t], "keep": t, "obj": Movable(), "s": "x"}
    out = send_to_device(data, torch.device("cpu"), skip_keys="keep")
    assert out["a"] is t  # already there: no copy
    assert out["keep"] is t and out["s"] == "x"
    assert out["obj"].moved_to == torch.device("cpu")
    out = send_to_device(data, "meta", skip_keys=["keep"])
    assert out["a"].device.type == "meta" and out["b"][0].device.type == "meta"
    assert out["keep"].device.type == "cpu"


def test_data_structure_round_trip():
    info = get_data_structure(nested())
    assert info["ids"] == TensorInformation((3, 2), torch.int64)
    assert info["rest"][1].second == "label"
    rebuilt = initialize_tensors(info)
    assert rebuilt["rest"][1].first.shape == (3, 1) and rebuilt["rest"][1].first.dtype == torch.float64


def test_find_batch_size():
    assert find_batch_size(nested()) == 3
    assert find_batch_size([torch.ones(5, 2)]) == 5
    with pytest.raises(TypeError, match="holds no tensor"):
        find_batch_size({"a": 1})
    with pytest.raises(ValueError, match="0-d"):
        find_batch_size(torch.tensor(1.0))


def test_concatenate_and_slice():
    data = nested()
    both = concatenate([data, data])
    assert both["ids"].shape == (6, 2) and both["rest"][1].first.shape == (6, 1)
    assert both["note"] == "text"
    first = slice_tensors(both, slice(0, 3))
    assert_same(first, {**data})
    with pytest.raises(ValueError, match="at least one"):
        concatenate([])


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.int64, torch.float64]), min_size=4, max_size=4),
)
def test_concatenate_then_slice_gives_back_each_part(shapes, dtypes):
    data = [torch.randn(*s).to(dtypes[i % 4]) for i, s in enumerate(shapes)]
    again = [torch.randn(*s).to(dtypes[i % 4]) for i, s in enumerate(shapes)]
    both = concatenate([data, again])
    n = [t.shape[0] for t in data]
    for i, t in enumerate(both):
        assert torch.equal(t[: n[i]], data[i]) and torch.equal(t[n[i] :], again[i])


def test_pad_helper_pads_where_asked():
    t = torch.ones(2, 3)
    end = ops._pad(t, 0, 4, pad_index=-1, pad_first=False)
    start = ops._pad(t, 1, 5, pad_index=7, pad_first=True)
    assert end[2:].eq(-1).all() and end[:2].eq(1).all()
    assert start[:, :2].eq(7).all() and start[:, 2:].eq(1).all()
    assert ops._pad(t, 2, 9, 0, False) is t
