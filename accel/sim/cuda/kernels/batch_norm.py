"""SyncBatchNorm's CUDA kernels on a simulated GPU: their math on the host, their results on the card.

`nn.SyncBatchNorm` in training calls ops that a CPU build of torch has no kernel for
(`batch_norm_stats`, `batch_norm_gather_stats_with_counts`, `batch_norm_elemt`,
`batch_norm_backward_reduce`, `batch_norm_backward_elemt`): vision models trained with DDP
(torchvision's `--sync-bn`, timm, detectron2) stop there on simulated GPUs without them.
Each handler here does what the CUDA kernel of torch 2.13 does (Normalization.cu/.cuh):

* the statistics are computed in the accumulate type (float32 for half and bfloat16 inputs)
  and returned in it, as the kernels' `acc_type` outputs are;
* the per-rank statistics are merged as the kernel merges them: each rank's variance is
  recovered from its invstd (1/invstd^2 - eps), weighted by its count; the running mean and
  the unbiased running variance are updated in place, in their own dtype;
* results have the kernels' layouts: `batch_norm_elemt` keeps the input's suggested memory
  format, `batch_norm_backward_elemt` writes a contiguous gradient unless the input is
  channels-last, and the weight and bias gradients have the weight's dtype.

Each result is taken from the simulated GPU's memory when made. With shapes only, the
results are shapes, and running statistics are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.core import device_rules
from accel.sim.cuda.tensors.cuda_tensor import host_tensors, wrap_like

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulate type (`acc_type<scalar_t, /*is_cuda=*/true>`) for a floating dtype."""
    return torch.float32 if dtype in _HALF else dtype


def _planes(x: torch.Tensor) -> torch.Tensor:
    """`x` (N, C, ...) as (C, N * ...) in the accumulate type: one row per channel, as the kernels reduce."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).to(_acc(x.dtype))


def _per_channel(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over `x` (N, C, ...)."""
    return values.reshape(1, -1, *([1] * (x.dim() - 2)))


def _scalar_name(dtype: torch.dtype) -> str:
    return device_rules.SCALAR_NAMES.get(dtype, str(dtype))


def _check_floating(x: torch.Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise RuntimeError(f"\"{name}\" not implemented for '{_scalar_name(x.dtype)}'")


def stats(args: tuple, kwargs: dict) -> tuple:
    """`batch_norm_stats(input, eps)` -> (mean, invstd) of each channel, in the accumulate type."""
    source, eps = args[0], args[1]
    (x,) = host_tensors(source)
    _check_floating(x, "batch_norm_stats_cuda")
    planes = _planes(x)
    mean = planes.mean(1)
    invstd = (planes.var(1, correction=0) + eps).rsqrt()
    return wrap_like(mean, source), wrap_like(invstd, source)


def gather_stats_with_counts(args: tuple, kwargs: dict) -> tuple:
    """`batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts)`.

    Merges the (world, C) statistics of the ranks, weighted by their counts, and updates the running ones.
    """
    source, means, invstds, running_mean, running_var, momentum, eps, counts = args[:8]
    stats_and_counts = host_tensors(source, means, invstds, running_mean, running_var, counts)
    _, mean_all, invstd_all, run_mean, run_var, count = stats_and_counts
    acc = _acc(mean_all.dtype)
    mean_all, invstd_all = mean_all.to(acc), invstd_all.to(acc)
    weights = count.to(acc).unsqueeze(1)
    total = weights.sum(0)
    mean = (weights * mean_all).sum(0) / total
    variance = invstd_all.reciprocal().square() - eps  # each rank's biased variance
    spread = (weights * (variance + (mean_all - mean).square())).sum(0)  # sum of squared deviations
    invstd = (spread / total + eps).rsqrt()
    if run_mean is not None and not run_mean.is_meta:
        run_mean.copy_((1 - momentum) * run_mean.to(acc) + momentum * mean)
    if run_var is not None and not run_var.is_meta:
        run_var.copy_((1 - momentum) * run_var.to(acc) + momentum * spread / (total - 1))
    return wrap_like(mean, source), wrap_like(invstd, source)


def gather_stats(args: tuple, kwargs: dict) -> tuple:
    """`batch_norm_gather_stats(..., count: int)`: every rank counted `count` values."""
    source, means = args[0], args[1]
    running_mean = args[3]
    count_dtype = running_mean.dtype if running_mean is not None else source.dtype
    counts = torch.full((means.shape[0],), args[7], dtype=count_dtype, device=means.device)
    return gather_stats_with_counts((*args[:7], counts), kwargs)


def elemt(args: tuple, kwargs: dict) -> Any:
    """`batch_norm_elemt(input, weight, bias, mean, invstd, eps)`: (x - mean) * invstd * weight + bias."""
    source = args[0]
    x, weight, bias, mean, invstd = host_tensors(*args[:5])
    acc = mean.dtype
    y = (x.to(acc) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight.to(acc), x)
    if bias is not None:
        y = y + _per_channel(bias.to(acc), x)
    out = torch.empty_like(x, memory_format=_suggested_format(x))
    return wrap_like(out if out.is_meta else out.copy_(y), source)


def backward_reduce(args: tuple, kwargs: dict) -> tuple:
    """`batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g)`.

    -> (sum_dy, sum_dy_xmu, grad_weight, grad_bias), each None where not asked for.
    """
    grad_out = args[0]
    input_g, weight_g, bias_g = args[5:8]
    g, x, mean, invstd, weight = host_tensors(*args[:5])
    planes_g = _planes(g).to(mean.dtype)
    sum_dy = planes_g.sum(1)
    sum_dy_xmu = (planes_g * (_planes(x).to(mean.dtype) - mean.unsqueeze(1))).sum(1)
    grad_dtype = weight.dtype if weight is not None else x.dtype
    results = (
        sum_dy if input_g else None,
        sum_dy_xmu if input_g else None,
        (sum_dy_xmu * invstd).to(grad_dtype) if weight_g else None,
        sum_dy.to(grad_dtype) if bias_g else None,
    )
    return tuple(None if r is None else wrap_like(r, grad_out) for r in results)


def backward_elemt(args: tuple, kwargs: dict) -> Any:
    """`batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count)`: the input's
    gradient, with the sums already reduced over the ranks and `count` (int32) the values each rank counted."""
    grad_out = args[0]
    g, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count = host_tensors(*args[:8])
    if count.dtype != torch.int32:
        raise RuntimeError(f"expected scalar type Int but found {_scalar_name(count.dtype)}")
    acc = mean.dtype
    norm = 1.0 if count.is_meta else 1.0 / int(count.sum())  # shapes only: the values mean nothing
    scale = invstd if weight is None else invstd * weight.to(acc)
    centred = x.to(acc) - _per_channel(mean, x)
    projection = _per_channel(sum_dy_xmu * norm * invstd.square(), x)
    grad = (g.to(acc) - centred * projection - _per_channel(sum_dy * norm, x)) * _per_channel(scale, x)
    channels_last = _suggested_format(g) is not torch.contiguous_format
    out = torch.empty_like(g, memory_format=_suggested_format(g) if channels_last else torch.contiguous_format)
    return wrap_like(out if out.is_meta else out.copy_(grad), grad_out)


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """`suggest_memory_format()`: channels-last when `x` is laid out so (4-D and 5-D), else contiguous."""
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def handlers() -> dict[Any, Any]:
    """The CUDA-only batch-norm ops -> their handlers on simulated CUDA tensors (`cuda_tensor.add_special`)."""
    return {
        aten.batch_norm_stats.default: stats,
        aten.batch_norm_gather_stats_with_counts.default: gather_stats_with_counts,
        aten.batch_norm_gather_stats.default: gather_stats,
        aten.batch_norm_elemt.default: elemt,
        aten.batch_norm_backward_reduce.default: backward_reduce,
        aten.batch_norm_backward_elemt.default: backward_elemt,
    }
