"""Single-process tests of the operations on nested structures (multi-rank ones: tests/multiproc/)."""

import collections
import pickle
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.utils import operations as ops
from accel.utils.operations import (
    CannotPadNestedTensorWarning,
    TensorInformation,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    find_device,
    gather,
    gather_object,
    get_data_structure,
    initialize_tensors,
    is_namedtuple,
    listify,
    pad_across_processes,
    pad_input_tensors,
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
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_recursively_apply_keeps_containers_and_non_tensors():
    out = recursively_apply(lambda t: t + 1, nested())
    assert isinstance(out["rest"][1], Pair) and out["rest"][1].second == "label"
    assert torch.equal(out["ids"], torch.arange(1, 7).view(3, 2))
    assert out["note"] == "text" and out["count"] == 7


def test_recursively_apply_can_reject_other_types():
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\)"):
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
    with pytest.raises(ValueError, match="'avg'.*use one of mean, sum, max, min, none"):
        reduce(torch.ones(1), "avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "max", "min", "none"])
def test_single_process_reduce_matches_accelerate(reduction, peer_state):
    from accelerate.utils import reduce as peer_reduce

    data = {"a": torch.arange(4.0), "b": [torch.tensor([3, 1])]}
    ours, theirs = reduce(data, reduction), peer_reduce(data, reduction)
    assert torch.equal(ours["a"], theirs["a"]) and torch.equal(ours["b"][0], theirs["b"][0])


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
    data = {"ids": torch.arange(6).view(3, 2), "rest": [torch.ones(3), Pair(torch.zeros(3, 1), torch.ones(3))]}
    both = concatenate([data, data])
    assert both["ids"].shape == (6, 2) and both["rest"][1].first.shape == (6, 1)
    first = slice_tensors(both, slice(0, 3))
    assert_same(first, data)
    with pytest.raises(ValueError, match="at least one"):
        concatenate([])


def test_concatenate_refuses_non_tensor_leaves_as_accelerate_does():
    from accelerate.utils import concatenate as peer_concatenate

    batches = [{"x": torch.ones(2), "name": "a"}, {"x": torch.ones(2), "name": "b"}]
    with pytest.raises(TypeError, match="can only concatenate tensors"):
        concatenate(batches)
    with pytest.raises(TypeError):
        peer_concatenate(batches)
    # One batch: its non-tensor values come back as they are, in both libraries.
    single = [{"x": torch.ones(2), "name": "a"}]
    assert concatenate(single)["name"] == peer_concatenate(single)["name"] == "a"


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


@pytest.fixture
def peer_state():
    """Accelerate's own (single-process) state, for side-by-side comparisons; reset afterwards."""
    from accelerate.state import AcceleratorState as PeerAcceleratorState
    from accelerate.state import PartialState as PeerState

    yield PeerState(cpu=True)
    PeerAcceleratorState._reset_state(reset_partial_state=True)


def test_is_namedtuple_matches_accelerate():
    from accelerate.utils import is_namedtuple as peer

    class Typed(NamedTuple):
        a: int

    for value in [Pair(1, 2), Typed(1), (1, 2), [1, 2], {"a": 1}, torch.ones(1), "ab"]:
        assert is_namedtuple(value) == peer(value)
    assert is_namedtuple(Pair(1, 2)) and is_namedtuple(Typed(1)) and not is_namedtuple((1, 2))


nested_values = st.recursive(
    st.one_of(
        st.builds(
            lambda shape, dtype: torch.randn(tuple(shape)).to(dtype),
            st.lists(st.integers(0, 3), max_size=3),
            st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.float64]),
        ),
        st.integers(-5, 5),
        st.text(max_size=3),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children).map(lambda pair: Pair(*pair)),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
    ),
    max_leaves=8,
)


def _equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    else:
        assert a == b


@settings(max_examples=60, deadline=None)
@given(data=nested_values)
def test_listify_convert_to_fp32_and_find_device_match_accelerate(data):
    from accelerate.utils import convert_to_fp32 as peer_fp32
    from accelerate.utils import find_device as peer_find_device
    from accelerate.utils import listify as peer_listify

    assert listify(data) == peer_listify(data)
    converted = convert_to_fp32(data)
    _equal(converted, peer_fp32(data))
    assert all(t.dtype not in (torch.float16, torch.bfloat16) for t in ops._leaves(converted, []))
    assert find_device(data) == peer_find_device(data)


def test_listify_gives_plain_numbers():
    out = listify({"a": torch.tensor([[1.5, 2.0]], dtype=torch.bfloat16), "b": (torch.tensor(3),)})
    assert out == {"a": [[1.5, 2.0]], "b": (3,)}
    assert find_device({"none": 1}) is None


def test_convert_outputs_to_fp32_wraps_a_forward():
    model = torch.nn.Linear(2, 2).half()
    forward = convert_outputs_to_fp32(model.forward)
    out = forward(torch.ones(1, 2, dtype=torch.float16))
    assert out.dtype == torch.float32
    # a class, not a local function: unwrapping follows __wrapped__ to the original forward
    assert forward.model_forward == model.forward and forward.__wrapped__ == model.forward
    with pytest.raises(pickle.PicklingError, match="unwrap_model"):
        pickle.dumps(forward)


@settings(max_examples=80, deadline=None)
@given(batch_size=st.integers(1, 17), num_processes=st.integers(1, 8), features=st.integers(1, 3))
def test_pad_input_tensors_matches_accelerate(batch_size, num_processes, features):
    from accelerate.utils import pad_input_tensors as peer

    batch = {"x": torch.arange(batch_size * features).view(batch_size, features), "y": [torch.ones(batch_size)]}
    ours, theirs = pad_input_tensors(batch, batch_size, num_processes), peer(batch, batch_size, num_processes)
    _equal(ours, theirs)
    assert torch.equal(ours["x"][:batch_size], batch["x"])  # the inputs come first, unchanged
    assert not ours["x"][batch_size:].any()  # the padding is zeros


def test_pad_input_tensors_refuses_non_tensors():
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\)"):
        pad_input_tensors({"x": torch.ones(3), "s": "text"}, 3, 2)


def test_cannot_pad_nested_tensor_warning_is_a_user_warning():
    from accelerate.utils import CannotPadNestedTensorWarning as Peer

    assert issubclass(CannotPadNestedTensorWarning, UserWarning) and issubclass(Peer, UserWarning)
