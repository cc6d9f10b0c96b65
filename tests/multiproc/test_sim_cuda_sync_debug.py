"""`torch.cuda.set_sync_debug_mode` on simulated GPUs: what makes the host wait for the GPU is reported
("warn") or refused ("error"), as c10/cuda reports it; what does not, is not."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_each_wait_for_the_gpu_is_refused_in_error_mode():
    x = torch.arange(6.0, device="cuda")
    index = torch.tensor([0, 1], device="cuda")
    counts = torch.ones(6, dtype=torch.long, device="cuda")
    pinned = torch.ones(2).pin_memory()
    torch.cuda.set_sync_debug_mode("error")
    waits = {
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(x[1]),
        "tolist": x.tolist,
        "cpu": x.cpu,
        "to cuda from pageable memory": lambda: torch.ones(2).to("cuda"),
        "copy into a host tensor": lambda: torch.empty(6).copy_(x),
        "masked index": lambda: x[x > 2],
        "nonzero": x.nonzero,
        "masked_select": lambda: x.masked_select(x > 1),
        "unique": lambda: torch.unique(x),
        "repeat_interleave": lambda: x.repeat_interleave(counts),
        "bincount": lambda: torch.bincount(counts),
        "equal": lambda: torch.equal(x, x),
        "stream synchronize": lambda: torch.cuda.current_stream().synchronize(),
    }
    for name, wait in waits.items():
        with pytest.raises(RuntimeError, match="^called a synchronizing CUDA operation$"):
            wait()
            raise AssertionError(f"{name} was not reported")
    # no wait: GPU work, indexing by a tensor of indices, non-blocking copies, the given output size, explicit syncs
    (x * 2).sum()
    x[index]
    pinned.to("cuda", non_blocking=True)
    x.to("cpu", non_blocking=True)
    x.repeat_interleave(counts, output_size=6)
    torch.cuda.synchronize()
    torch.cuda.Event().synchronize()
    torch.cuda.set_sync_debug_mode("default")
    assert x.sum().item() == 15.0


@distributed_test(world_size=SIZES, device="cuda")
def test_warn_mode_warns_and_the_mode_reads_back():
    x = torch.ones(3, device="cuda")
    torch.cuda.set_sync_debug_mode(1)
    assert torch.cuda.get_sync_debug_mode() == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert x.sum().item() == 3.0
    assert [str(w.message) for w in caught] == ["called a synchronizing CUDA operation"]
    with pytest.raises(RuntimeError, match="expected one of `default`, `warn`, `error`"):
        torch.cuda.set_sync_debug_mode("loud")
    torch.cuda.set_sync_debug_mode(0)
    assert torch.cuda.get_sync_debug_mode() == 0


@distributed_test(world_size=SIZES, device="cuda")
def test_ddp_and_fsdp2_steps_after_warm_up_make_the_host_wait_nowhere(rank):
    from torch.distributed.fsdp import fully_shard

    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda())
    sharded = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).cuda()
    fully_shard(sharded[0])
    fully_shard(sharded)
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (ddp, sharded)]
    x = torch.randn(8, 16, device="cuda")

    def step():
        for model, optimizer in zip((ddp, sharded), optimizers, strict=True):
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        total = torch.ones(4, device="cuda")
        dist.all_reduce(total)
        return total

    step()
    step()  # DDP rebuilds its buckets in the second step, copying their indices through the host (a wait)
    torch.cuda.set_sync_debug_mode("error")
    total = step()  # the simulated NCCL group and the simulator's own work make the host wait nowhere
    torch.cuda.set_sync_debug_mode(0)
    assert total.tolist() == [float(dist.get_world_size())] * 4
