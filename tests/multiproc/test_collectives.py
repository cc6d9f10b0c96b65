"""Operations across real ranks, on simulated CPU, CUDA and XLA hardware."""

import collections

import pytest
import torch

from harness import distributed_test

Pair = collections.namedtuple("Pair", "first second")

SIZES = [2, 4]
DEVICES = ["cpu", "cuda", "xla"]


def _nested(rank, device):
    return {
        "x": torch.full((2, 3), float(rank), device=device),
        "ids": [torch.arange(4, device=device) + rank, Pair(torch.tensor(float(rank), device=device), "tag")],
        "half": torch.full((1,), rank, dtype=torch.float16, device=device),
        "n": rank,
    }


@distributed_test(world_size=SIZES, device=DEVICES)
def test_gather_nested(rank, world_size):
    from accel.state import PartialState
    from accel.utils import gather

    state = PartialState()
    out = gather(_nested(rank, state.device))
    assert out["x"].shape == (2 * world_size, 3)
    assert out["x"][::2, 0].tolist() == [float(r) for r in range(world_size)]
    assert out["ids"][0].tolist() == [i + r for r in range(world_size) for i in range(4)]
    assert out["ids"][1].first.tolist() == [float(r) for r in range(world_size)]
    assert out["ids"][1].second == "tag" and out["n"] == rank
    assert out["half"].dtype == torch.float16 and out["half"].tolist() == list(range(world_size))


@distributed_test(world_size=SIZES, device=DEVICES)
def test_nested_structure_costs_one_collective_per_dtype(rank, world_size):
    from accel.state import PartialState
    from accel.utils import gather, reduce

    state = PartialState()
    hardware = state.hardware
    calls = []
    original_gather, original_reduce = hardware.all_gather_into, hardware.all_reduce
    hardware.all_gather_into = lambda out, t: calls.append("gather") or original_gather(out, t)
    hardware.all_reduce = lambda t, op="sum": calls.append("reduce") or original_reduce(t, op)
    # on the device: simulated GPUs speak NCCL, which refuses CPU tensors
    data = {k: torch.ones(3, device=state.device) * rank for k in "abcdefgh"}
    data["ints"] = [
        torch.ones(2, dtype=torch.int64, device=state.device),
        torch.zeros(1, dtype=torch.int64, device=state.device),
    ]
    gather(data)
    reduce(data, "sum")
    assert calls == ["gather", "gather", "reduce", "reduce"]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_gather_object_concatenates_lists(rank, world_size):
    from accel.utils import gather_object

    assert gather_object([rank, f"r{rank}"]) == [x for r in range(world_size) for x in (r, f"r{r}")]
    assert gather_object({"rank": rank}) == [{"rank": r} for r in range(world_size)]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_broadcast_nested_from_any_process(rank, world_size):
    from accel.state import PartialState
    from accel.utils import broadcast, broadcast_object_list

    device = PartialState().device
    src = world_size - 1
    data = {"a": torch.full((2, 2), float(rank), device=device), "b": [torch.tensor([rank, rank], device=device)]}
    out = broadcast(data, from_process=src)
    assert out["a"].eq(src).all() and out["b"][0].tolist() == [src, src]
    assert data["a"].eq(src).all()  # in place
    objects = [rank, {"from": rank}]
    broadcast_object_list(objects, from_process=1)
    assert objects == [1, {"from": 1}]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_reduce_sum_and_mean(rank, world_size):
    from accel.state import PartialState
    from accel.utils import reduce

    device = PartialState().device
    data = {"f": torch.full((3,), float(rank + 1), device=device), "i": [torch.tensor([rank], device=device)]}
    total = sum(range(1, world_size + 1))
    summed = reduce(data, "sum")
    assert summed["f"].tolist() == [float(total)] * 3 and summed["i"][0].tolist() == [sum(range(world_size))]
    mean = reduce(data, "mean")
    assert torch.allclose(mean["f"], torch.full((3,), total / world_size, device=device))
    assert data["f"].tolist() == [float(rank + 1)] * 3  # inputs untouched


@distributed_test(world_size=SIZES, device=DEVICES)
@pytest.mark.parametrize("pad_first", [False, True])
def test_pad_across_processes_then_gather(rank, world_size, pad_first):
    from accel.state import PartialState
    from accel.utils import gather, pad_across_processes

    device = PartialState().device
    data = {"rows": torch.ones(rank + 1, 2, device=device), "cols": [torch.ones(2, rank + 1, device=device)]}
    padded = pad_across_processes(data, dim=0, pad_index=-1, pad_first=pad_first)
    assert padded["rows"].shape == (world_size, 2)
    assert padded["cols"][0].shape == (2, rank + 1)  # other dims untouched
    rows = gather(padded["rows"]).view(world_size, world_size, 2)
    for r in range(world_size):
        real = rows[r, world_size - r - 1 :] if pad_first else rows[r, : r + 1]
        assert real.eq(1).all() and (rows[r] == -1).sum() == 2 * (world_size - r - 1)
    by_column = pad_across_processes(data["cols"][0], dim=1)
    assert by_column.shape == (2, world_size)


@distributed_test(world_size=SIZES, device=DEVICES)
def test_debug_mode_lists_every_rank_shape(rank, world_size):
    from accel.state import PartialState
    from accel.utils import DistributedOperationException, gather

    state = PartialState()
    state.debug = True
    with pytest.raises(DistributedOperationException) as info:
        gather({"a": torch.ones(rank + 1, device=state.device)})
    message = str(info.value)
    for r in range(world_size):
        assert f"rank {r}: [({r + 1},)]" in message
    assert "pad_across_processes" in message


@distributed_test(world_size=SIZES, device=DEVICES)
def test_set_seed_and_synchronize_rng(rank, world_size):
    from accel.state import PartialState
    from accel.utils import gather, set_seed, synchronize_rng_states

    device = PartialState().device  # gathered there: simulated GPUs speak NCCL, which refuses CPU tensors
    torch.manual_seed(100 + rank)
    synchronize_rng_states(["torch"])
    draws = gather(torch.rand(2).to(device))
    assert all(torch.equal(draws[2 * r : 2 * r + 2], draws[:2]) for r in range(world_size))
    set_seed(7, device_specific=True)
    assert gather(torch.rand(1).to(device)).unique().numel() == world_size
    gen = torch.Generator().manual_seed(rank)
    synchronize_rng_states(["generator"], generator=gen)
    assert gather(torch.rand(1, generator=gen).to(device)).unique().numel() == 1


@distributed_test(world_size=SIZES, device=["cuda", "xla"])
def test_device_generator_synchronised(rank, world_size, device):
    from accel.state import PartialState
    from accel.utils import gather_object, synchronize_rng_states

    hardware = PartialState().hardware
    hardware.manual_seed(rank + 1)
    synchronize_rng_states([device])
    states = gather_object([hardware.get_rng_state().tolist()])
    assert all(s == states[0] for s in states)
