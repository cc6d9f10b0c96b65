"""`nn.SyncBatchNorm` on simulated GPUs: its CUDA-only kernels (`accel.sim.cuda.kernels.batch_norm`) give what batch
normalization over the whole batch gives, on every rank, with uneven and empty shards, half inputs and channels-last."""

import math

import pytest
import torch
import torch.distributed as dist

from harness import distributed_test

SIZES = [2, 4]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())


def _whole_batch(world_size: int, sizes: list[int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(world_size)
    return torch.randn(sum(sizes), 3, 6, 6, generator=generator) * 3 + 1


def _shard(whole: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    return whole[sum(sizes[:rank]) : sum(sizes[: rank + 1])]


def _reference(whole: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """Plain batch normalization over the whole batch in one process (float64: the exact answer)."""
    model = _model().double()
    x = whole.double().requires_grad_()
    out = model(x)
    (out * _weights(out)).sum().backward()
    return model, out, x.grad


def _weights(out: torch.Tensor) -> torch.Tensor:
    """A loss weight per output value that differs per position, so every gradient term counts."""
    return torch.linspace(-1, 1, math.prod(out.shape[1:]), dtype=out.dtype, device=out.device).reshape(out.shape[1:])


@pytest.mark.parametrize("sizes_of", ["uneven", "one_empty"])
@distributed_test(world_size=SIZES, device="cuda")
def test_sync_batchnorm_equals_batchnorm_over_the_whole_batch(rank, world_size, sizes_of):
    torch.cuda.set_device(rank)
    sizes = [r + 2 for r in range(world_size)] if sizes_of == "uneven" else [3] * (world_size - 1) + [0]
    whole = _whole_batch(world_size, sizes)
    expected_model, expected_out, expected_grad = _reference(whole)

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(_model()).cuda()
    x = _shard(whole, sizes, rank).cuda().requires_grad_()
    out = model(x)
    (out * _weights(out)).sum().backward()

    start = sum(sizes[:rank])
    assert out.device == x.device and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), expected_out[start : start + sizes[rank]], rtol=1e-5, atol=1e-5)
    if sizes[rank]:
        torch.testing.assert_close(
            x.grad.cpu().double(), expected_grad[start : start + sizes[rank]], rtol=1e-4, atol=1e-5
        )
    else:
        assert x.grad is None  # SyncBatchNorm gives an empty shard no gradient (zeros to autograd), as on GPUs
    norm, expected_norm = model[1], expected_model[1]
    assert isinstance(norm, torch.nn.SyncBatchNorm) and norm.running_mean.device == x.device
    torch.testing.assert_close(norm.running_mean.cpu().double(), expected_norm.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_var.cpu().double(), expected_norm.running_var, rtol=1e-5, atol=1e-6)
    # parameter gradients are per rank (DDP sums them): their sum over the ranks is the whole batch's
    for param, expected in zip(model.parameters(), expected_model.parameters(), strict=True):
        grad = torch.zeros_like(param) if param.grad is None else param.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad.cpu().double(), expected.grad, rtol=1e-4, atol=1e-4)


@distributed_test(world_size=[2], device="cuda")
def test_half_channels_last_inputs_keep_the_kernels_dtypes_and_layouts(rank, world_size):
    torch.cuda.set_device(rank)
    norm = torch.nn.SyncBatchNorm(4).cuda()  # float32 parameters, as under autocast
    x = torch.randn(2, 4, 5, 5, device="cuda").to(torch.bfloat16, memory_format=torch.channels_last)
    x.requires_grad_()
    before = torch.cuda.memory_allocated()
    mean, invstd = torch.batch_norm_stats(x.detach(), 1e-5)
    assert mean.dtype == invstd.dtype == torch.float32 and mean.shape == (4,)
    assert torch.cuda.memory_allocated() - before == 2 * 512  # two results on the card, a 512-byte block each
    out = norm(x)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    out.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.is_contiguous(memory_format=torch.channels_last)
    assert norm.weight.grad.dtype == torch.float32 and norm.running_mean.dtype == torch.float32
    with pytest.raises(RuntimeError, match="\"batch_norm_stats_cuda\" not implemented for 'Long'"):
        torch.batch_norm_stats(torch.ones(2, 3, dtype=torch.long, device="cuda"), 1e-5)


@distributed_test(world_size=SIZES, device="cuda")
def test_ddp_with_sync_batchnorm_trains_as_one_process_on_the_whole_batch(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(rank)
    sizes = [2] * world_size
    whole = _whole_batch(world_size, sizes)
    model = DistributedDataParallel(torch.nn.SyncBatchNorm.convert_sync_batchnorm(_model()).cuda(), device_ids=[rank])
    reference = _model()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):
        for net, batch, optimizer in (
            (model, _shard(whole, sizes, rank).cuda(), optimizers[0]),
            (reference, whole, optimizers[1]),
        ):
            optimizer.zero_grad()
            net(batch + step).square().mean().backward()
            optimizer.step()
    for param, expected in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.detach().cpu(), expected.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.module[1].running_var.cpu(), reference[1].running_var, rtol=1e-5, atol=1e-6)
