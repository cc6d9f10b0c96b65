"""One process driving all its simulated GPUs: `nn.DataParallel` and `torch.cuda.comm`.

Each rank of these tests sees `world_size` GPUs, so DataParallel replicates over 2 and 4 of
them (what a script run with plain `python` on a multi-GPU host does, and what the Trainer
does when one process sees several GPUs).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.cuda.comm as comm
import torch.nn as nn

from harness import distributed_test

SIZES = [2, 4]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


@distributed_test(world_size=SIZES, device="cuda")
def test_data_parallel_trains_as_one_gpu_on_the_whole_batch(world_size):
    torch.cuda.set_device(0)
    model, reference = _model().cuda(), _model().cuda()
    parallel = nn.DataParallel(model)
    assert parallel.device_ids == list(range(world_size))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    seen = []
    # (a hook: replicas carry it, each called with its own module and piece of the batch)
    model.register_forward_pre_hook(
        lambda module, args: seen.append((torch.cuda.current_device(), args[0].device.index, args[0].shape[0]))
    )
    for step in range(3):
        batch = torch.randn(4 * world_size + 2, 8, generator=torch.Generator().manual_seed(step)).cuda()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "not compiled with NCCL support" on the way
            loss = parallel(batch).square().mean()
            loss.backward()
        reference(batch).square().mean().backward()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    # each replica ran on its own GPU, in a thread whose current GPU is that one; the batch split as torch splits
    chunks = [len(c) for c in torch.empty(4 * world_size + 2).chunk(world_size)]
    assert sorted(seen[:world_size]) == [(i, i, chunks[i]) for i in range(world_size)]
    assert torch.cuda.current_device() == 0  # the caller's GPU is untouched by the replicas' threads
    assert parallel(batch).device == torch.device("cuda", 0)


@distributed_test(world_size=SIZES, device="cuda")
def test_replicas_and_gathered_outputs_take_memory_on_their_gpus(world_size):
    torch.cuda.set_device(0)
    parallel = nn.DataParallel(nn.Linear(1024, 1024).cuda())  # 4 MiB of weights
    before = [torch.cuda.memory_allocated(i) for i in range(world_size)]
    out = parallel(torch.randn(64 * world_size, 1024, device="cuda"))
    peaks = [torch.cuda.max_memory_allocated(i) for i in range(world_size)]
    # every other GPU held a replica (weights and bias) and its piece of the batch and of the output
    for i in range(1, world_size):
        assert before[i] == 0 and peaks[i] >= 4 * (1 << 20) + 2 * 64 * 1024 * 4
    assert torch.cuda.memory_allocated(0) - before[0] >= out.numel() * 4  # the gathered output on GPU 0
    assert out.shape == (64 * world_size, 1024)


@distributed_test(world_size=SIZES, device="cuda")
def test_comm_broadcast_scatter_gather_and_reduce_as_torch_defines_them(world_size):
    devices = list(range(world_size))
    x = torch.arange(6.0, device="cuda:0")
    copies = comm.broadcast(x, devices)
    assert copies[0] is x and [c.device.index for c in copies] == devices
    assert all(torch.equal(c.cpu(), x.cpu()) for c in copies)
    with pytest.raises(RuntimeError, match="must appear as the first on devices list"):
        comm.broadcast(x, devices[::-1])
    out = [torch.empty(6, device=f"cuda:{i}") for i in devices]
    assert all(torch.equal(o.cpu(), x.cpu()) for o in comm.broadcast(x, out=out))
    coalesced = comm.broadcast_coalesced([x, x.view(2, 3)], devices)
    assert coalesced[0][0] is x and coalesced[-1][1].shape == (2, 3) and coalesced[-1][1].device.index == devices[-1]
    # scatter: even pieces, or the sizes asked for; gather: one result on the destination (or the CPU)
    pieces = comm.scatter(torch.arange(4.0 * world_size), devices)
    assert [p.device.index for p in pieces] == devices and all(len(p) == 4 for p in pieces)
    sizes = [1] * (world_size - 1) + [4 * world_size - (world_size - 1)]
    assert [len(p) for p in comm.scatter(torch.arange(4.0 * world_size), devices, chunk_sizes=sizes)] == sizes
    gathered = comm.gather(pieces, destination=world_size - 1)
    assert gathered.device.index == world_size - 1 and torch.equal(gathered.cpu(), torch.arange(4.0 * world_size))
    assert comm.gather(pieces, destination="cpu").device.type == "cpu"
    with pytest.raises(RuntimeError, match="invalid shape"):
        comm.gather([torch.ones(2, 3, device="cuda:0"), torch.ones(2, 4, device="cuda:1")], dim=0)
    summed = comm.reduce_add([torch.ones(3, device=f"cuda:{i}") for i in devices], destination=1)
    assert summed.device.index == 1 and summed.tolist() == [float(world_size)] * 3
