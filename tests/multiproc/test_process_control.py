"""Shared state and process control across real ranks, on simulated CPU, CUDA and XLA hardware."""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]
DEVICES = ["cpu", "cuda", "xla"]
EXPECTED_TYPE = {"cpu": "MULTI_CPU", "cuda": "MULTI_GPU", "xla": "XLA"}


@distributed_test(world_size=SIZES, device=DEVICES)
def test_topology_matches_the_simulated_hardware(rank, world_size, local_rank, device):
    from accel.state import AcceleratorState, PartialState

    state = PartialState()
    assert state.process_index == rank and state.num_processes == world_size
    assert state.local_process_index == local_rank
    assert state.distributed_type == EXPECTED_TYPE[device]
    assert state.is_main_process == (rank == 0) and state.is_last_process == (rank == world_size - 1)
    assert AcceleratorState().num_processes == world_size


@distributed_test(world_size=SIZES, device=DEVICES)
@pytest.mark.parametrize("padding", [False, True])
def test_split_between_processes(rank, world_size, padding):
    from accel.state import PartialState
    from accel.utils import gather_object

    state = PartialState()
    items = list(range(2 * world_size + 1))  # one more than divides evenly: rank 0 gets 3
    with state.split_between_processes(items, apply_padding=padding) as mine:
        shares = gather_object([mine])
    expected = [[0, 1, 2]] + [[2 * r + 1, 2 * r + 2] for r in range(1, world_size)]
    if padding:
        expected = [s + [s[-1]] * (3 - len(s)) for s in expected]
    assert shares == expected
    with state.split_between_processes({"a": items, "b": torch.arange(len(items))}, apply_padding=padding) as part:
        assert part["a"] == expected[rank]
        assert part["b"].tolist() == expected[rank]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_main_process_first_orders_the_ranks(rank, world_size, tmp_path):
    from accel.state import PartialState

    state = PartialState()
    log = tmp_path / "order.txt"
    with state.main_process_first(), open(log, "a") as f:
        f.write(f"{rank}\n")
    state.wait_for_everyone()
    lines = log.read_text().split()
    assert lines[0] == "0" and sorted(lines) == [str(r) for r in range(world_size)]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_process_decorators(rank, world_size):
    from accel.state import PartialState
    from accel.utils import gather_object

    state = PartialState()

    @state.on_main_process
    def main():
        return "main"

    @state.on_last_process
    def last():
        return "last"

    @state.on_process(process_index=1)
    def second():
        return "second"

    @state.on_local_main_process
    def local_main():
        return "local"

    ran = gather_object([(main(), last(), second(), local_main())])
    assert ran[0] == ("main", None, None, "local")
    assert ran[1][2] == "second"
    assert ran[-1][1] == "last"
    assert sum(r[0] == "main" for r in ran) == 1
