"""The processes of a simulated node share its GPUs' memory, as the processes of a host do: what one
uses on GPU k the others cannot have, `mem_get_info` shows it, out-of-memory names it.

The ranks of one launch are one node. Every card here is 1 GiB, of which each process's CUDA
context takes 64 MiB once it uses the GPU; tensors of 10 MiB or more take segments of their own
size, so the arithmetic is exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import accel.sim
from harness import distributed_test

MiB = 1 << 20
CARD = "memory=1GiB,capability=8.0"
CONTEXT = 64 * MiB  # a 1 GiB card's context: a sixteenth of it
#: what each rank's first test keeps alive in the rank process (`test_a_test_leaves_no_memory_to_the_next`)
_KEPT: list[torch.Tensor] = []


def _free(index: int) -> int:
    return torch.cuda.mem_get_info(index)[0]


def _pids_and_sync() -> tuple[list[int], dist.ProcessGroup]:
    # Ranks sharing a GPU cannot share an NCCL communicator ("Duplicate GPU detected"): they talk over Gloo.
    group = dist.new_group(backend="gloo")
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid(), group=group)
    return pids, group


@distributed_test(world_size=[2], device="cuda", gpu=CARD)
def test_ranks_on_one_gpu_run_out_of_its_memory_together(rank):
    torch.cuda.set_device(0)
    pids, sync = _pids_and_sync()
    mine = []
    if rank == 0:
        mine.append(torch.empty(400 * MiB, dtype=torch.uint8, device="cuda"))
    dist.barrier(group=sync)
    if rank == 1:
        mine.append(torch.empty(400 * MiB, dtype=torch.uint8, device="cuda"))
        assert _free(0) == 1024 * MiB - 2 * (CONTEXT + 400 * MiB)
        # alone, 200 MiB more would fit (464 + 200 of 1024 MiB); beside rank 0 they do not
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        assert str(caught.value).startswith(
            "CUDA out of memory. Tried to allocate 200.00 MiB. GPU 0 has a total capacity of 1024.00 MiB of which "
            f"96.00 MiB is free. Process {pids[0]} has 464.00 MiB memory in use. Including non-PyTorch memory, "
            "this process has 464.00 MiB memory in use. Of the allocated memory 400.00 MiB is allocated by PyTorch"
        )
    dist.barrier(group=sync)
    if rank == 0:
        mine.clear()
        torch.cuda.empty_cache()  # the card has it back; the context stays
    dist.barrier(group=sync)
    if rank == 1:
        mine.append(torch.empty(200 * MiB, dtype=torch.uint8, device="cuda"))
        assert _free(0) == 1024 * MiB - CONTEXT - (CONTEXT + 600 * MiB)
    dist.barrier(group=sync)


@distributed_test(world_size=[2], device="cuda", gpu=CARD)
def test_ranks_filling_one_gpu_at_once_share_it_exactly(rank):
    torch.cuda.set_device(0)
    _, sync = _pids_and_sync()
    held = [torch.empty(1, device="cuda")]  # on the card now: the context and a 2 MiB segment
    dist.barrier(group=sync)
    while True:  # both at once: no piece of the card may be given twice
        try:
            held.append(torch.empty(50 * MiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
    counts = [0, 0]
    dist.all_gather_object(counts, len(held) - 1, group=sync)
    # 1024 MiB less two contexts and small segments holds 17 pieces of 50 MiB between the ranks;
    # alone, a rank holds 19
    assert sum(counts) == 17, counts
    dist.barrier(group=sync)


@distributed_test(world_size=[2], device="cuda", gpu=CARD)
def test_mem_get_info_shows_what_the_others_use_on_that_gpu_only(rank):
    _, sync = _pids_and_sync()
    if rank == 0:
        x = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda:0")
    dist.barrier(group=sync)
    if rank == 1:
        assert _free(0) == 1024 * MiB - CONTEXT - (CONTEXT + 300 * MiB)  # rank 0's, as nvidia-smi shows it
        assert _free(1) == 1024 * MiB - CONTEXT  # rank 0 never used GPU 1
    dist.barrier(group=sync)
    if rank == 0:
        del x
        torch.cuda.empty_cache()
    dist.barrier(group=sync)
    if rank == 1:
        assert _free(0) == 1024 * MiB - CONTEXT - CONTEXT  # rank 0's context stays while it lives
    dist.barrier(group=sync)


@distributed_test(world_size=[2], device="cuda", gpu=CARD)
def test_ranks_on_their_own_gpus_do_not_take_from_each_other(rank):
    _, sync = _pids_and_sync()
    x = torch.empty(800 * MiB, dtype=torch.uint8, device="cuda")  # cuda:rank; both on one card would not fit
    dist.barrier(group=sync)
    assert _free(rank) == 1024 * MiB - CONTEXT - 800 * MiB
    other = 1 - rank
    assert _free(other) == 1024 * MiB - CONTEXT - (CONTEXT + 800 * MiB)  # the other rank's GPU is full
    dist.barrier(group=sync)
    del x


@distributed_test(world_size=[2], device="cuda", gpu=CARD)
def test_gpus_are_the_hosts_whatever_cuda_visible_devices_calls_them(rank):
    if rank == 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # its cuda:0 is the host's GPU 1
    pids, sync = _pids_and_sync()
    if rank == 0:
        x = torch.empty(500 * MiB, dtype=torch.uint8, device="cuda:0")
    dist.barrier(group=sync)
    if rank == 1:
        assert _free(1) == 1024 * MiB - CONTEXT - (CONTEXT + 500 * MiB)
        assert _free(0) == 1024 * MiB - CONTEXT
        with pytest.raises(torch.OutOfMemoryError, match=f"GPU 1 .* Process {pids[0]} has 564.00 MiB memory in use"):
            torch.empty(500 * MiB, dtype=torch.uint8, device="cuda:1")
    dist.barrier(group=sync)
    if rank == 0:
        del x


@distributed_test(world_size=[2], device="cuda", gpu=CARD)
def test_a_forked_child_does_not_speak_for_its_parent(rank):
    _, sync = _pids_and_sync()
    if rank == 0:
        x = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda:0")
        del x  # its segment stays reserved: the card still holds it for this process
        child = os.fork()  # as a DataLoader worker: it inherits this process's allocators
        if child == 0:
            torch.cuda.empty_cache()  # the child's copy of the cache, not the parent's memory
            os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
    dist.barrier(group=sync)
    if rank == 1:
        assert _free(0) == 1024 * MiB - CONTEXT - (CONTEXT + 300 * MiB)
    dist.barrier(group=sync)


_HOLDER = """
    import os, sys
    from accel.sim.cuda.memory import node as node_memory
    seat = node_memory.seats([0])[0]  # the host's GPU 0
    node_memory.publish(seat, 300 << 20)
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    os._exit(0)  # no clean-up: as a crash leaves it
"""

_TAKER = """
    import os, sys, time
    from accel.sim.cuda.memory import node as node_memory
    seat = node_memory.seats([0])[0]
    with node_memory.deciding(seat):  # as a process between "it fits" and taking it
        print(os.getpid(), flush=True)
        time.sleep(0.5)  # the rank asks for memory meanwhile
        node_memory.publish(seat, 900 << 20)
    sys.stdin.readline()
"""


def _node_process(script: str) -> tuple[subprocess.Popen, int]:
    """Another process of this node running `script` (it prints its pid, then waits for a line)."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _end(process: subprocess.Popen, kill: bool = False) -> None:
    assert process.stdin is not None and process.stdout is not None
    if kill:
        process.kill()
    else:
        process.stdin.write("\n")
        process.stdin.flush()
    process.wait(30)
    process.stdin.close()
    process.stdout.close()


@distributed_test(world_size=[1], device="cuda", gpu=CARD, timeout=180)
def test_a_process_that_dies_leaves_nothing_counted():
    for kill in (False, True):  # os._exit, SIGKILL: neither gives its memory back itself
        holder, pid = _node_process(_HOLDER)
        assert _free(0) == 1024 * MiB - CONTEXT - 300 * MiB
        with pytest.raises(torch.OutOfMemoryError, match=f"Process {pid} has 300.00 MiB memory in use"):
            torch.empty(700 * MiB, dtype=torch.uint8, device="cuda:0")
        _end(holder, kill)
        assert _free(0) == 1024 * MiB - CONTEXT, kill
        x = torch.empty(700 * MiB, dtype=torch.uint8, device="cuda:0")
        del x
        torch.cuda.empty_cache()


@distributed_test(world_size=[1], device="cuda", gpu=CARD, timeout=180)
def test_memory_is_checked_and_taken_in_one_step():
    taker, pid = _node_process(_TAKER)
    # It has checked, not yet taken: this request waits for it, then finds its 900 MiB taken.
    with pytest.raises(torch.OutOfMemoryError, match=f"Process {pid} has 900.00 MiB memory in use"):
        torch.empty(500 * MiB, dtype=torch.uint8, device="cuda:0")
    _end(taker)


def _fill_gpu_0_and_keep_it() -> int:
    torch.cuda.set_device(0)
    _KEPT.append(torch.empty(400 * MiB, dtype=torch.uint8, device="cuda"))  # alive after the test
    return os.getpid()


def _use_all_of_gpu_0() -> tuple[int, int]:
    kept = len(_KEPT)
    if dist.get_rank() == 0:  # at once, without waiting for rank 1: its last test's memory must be gone already
        torch.cuda.set_device(0)
        assert _free(0) == 1024 * MiB - CONTEXT
        torch.empty(900 * MiB, dtype=torch.uint8, device="cuda")
    _KEPT.clear()
    return os.getpid(), kept


def test_a_test_leaves_no_memory_to_the_next():
    first = accel.sim.launch(_fill_gpu_0_and_keep_it, world_size=2, device="cuda", gpu=CARD)
    second = accel.sim.launch(_use_all_of_gpu_0, world_size=2, device="cuda", gpu=CARD)
    # the same warm ranks, still holding the first test's tensors
    assert [pid for pid, _ in second] == first
    assert [kept for _, kept in second] == [1, 1]
