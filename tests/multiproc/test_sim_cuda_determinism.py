"""`torch.use_deterministic_algorithms(True)` on simulated GPUs: the ops whose CUDA kernels are not
deterministic refuse (or warn under `warn_only=True`) with torch's message, where the host's
deterministic kernels would have passed; those torch makes deterministic pass."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness import distributed_test

SIZES = [2, 4]


def _refused(caller: str):
    return pytest.raises(RuntimeError, match=f"^{caller} does not have a deterministic implementation, but you set")


@distributed_test(world_size=SIZES, device="cuda")
def test_nondeterministic_cuda_kernels_refuse_with_torchs_message():
    floats = torch.randn(8, device="cuda")
    index = torch.tensor([0, 0, 1], device="cuda")
    torch.use_deterministic_algorithms(True)
    try:
        with _refused("cumsum_cuda_kernel"):
            floats.cumsum(0)
        with _refused("_histc_cuda with floating point input"):
            torch.histc(floats)
        with _refused("median CUDA with indices output"):
            floats.median(0)
        with _refused("kthvalue CUDA"):
            floats.kthvalue(2)
        with _refused("_bincount_cuda"):
            torch.bincount(index, weights=torch.ones(3, device="cuda"))
        with _refused("scatter_reduce_cuda_prod_"):
            torch.ones(2, device="cuda").scatter_reduce(0, index[:2], floats[:2], reduce="prod")
        with _refused("index_reduce_cuda"):
            torch.ones(2, device="cuda").index_reduce_(0, index, floats[:3], "amax")
        with _refused("put_"):
            torch.zeros(4, device="cuda").put_(index, floats[:3], accumulate=True)
        with _refused("nll_loss2d_forward_out_cuda_template"):  # cross entropy over an image's pixels
            F.cross_entropy(
                torch.randn(2, 3, 4, 4, device="cuda"), torch.zeros(2, 4, 4, dtype=torch.long, device="cuda")
            )
        # deterministic on the card (or made so by torch): these pass
        torch.arange(4, device="cuda").cumsum(0)
        floats.median()
        torch.bincount(index)
        torch.zeros(2, device="cuda").scatter_add_(0, index[:2], floats[:2])
        torch.zeros(2, device="cuda").index_add_(0, index, floats[:3])
        F.cross_entropy(torch.randn(3, 5, device="cuda"), index)
        torch.randn(4, 4, device="cuda") @ torch.randn(4, 4, device="cuda")  # no CUBLAS_WORKSPACE_CONFIG needed
    finally:
        torch.use_deterministic_algorithms(False)
    floats.cumsum(0)  # off again: allowed


@distributed_test(world_size=SIZES, device="cuda")
def test_backward_kernels_refuse_when_backward_returns_and_the_rank_lives_on():
    x = torch.randn(2, 3, 8, 8, device="cuda", requires_grad=True)
    torch.use_deterministic_algorithms(True)
    try:
        for caller, forward in (
            ("adaptive_avg_pool2d_backward_cuda", lambda: F.adaptive_avg_pool2d(x, 3)),
            ("upsample_bicubic2d_backward_out_cuda", lambda: F.interpolate(x, scale_factor=2, mode="bicubic")),
            ("reflection_pad2d_backward_cuda", lambda: F.pad(x, (1, 1, 1, 1), mode="reflect")),
            ("grid_sampler_2d_backward_cuda", lambda: F.grid_sample(x, torch.zeros(2, 4, 4, 2, device="cuda"))),
        ):
            loss = forward().sum()
            with _refused(caller):
                loss.backward()
        # torch's own deterministic routes: bilinear upsampling, replicate padding, a global average pool (a mean)
        F.interpolate(x, scale_factor=2, mode="bilinear").sum().backward()
        F.pad(x, (1, 1, 1, 1), mode="replicate").sum().backward()
        F.adaptive_avg_pool2d(x, 1).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    F.adaptive_avg_pool2d(x, 3).sum().backward()


@distributed_test(world_size=SIZES, device="cuda")
def test_warn_only_warns_and_a_ddp_step_of_a_convnet_runs_deterministic(rank):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.randn(5, device="cuda").cumsum(0)
        assert any(
            str(w.message).startswith("cumsum_cuda_kernel does not have a deterministic implementation")
            and "warn_only=True" in str(w.message)
            for w in caught
        )
        torch.use_deterministic_algorithms(True)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(model, nn.Linear(8, 4)).cuda())
        loss = F.cross_entropy(ddp(torch.randn(4, 3, 8, 8, device="cuda")), torch.arange(4, device="cuda"))
        loss.backward()
        dist.barrier()
    finally:
        torch.use_deterministic_algorithms(False)
