"""Stand-ins for CUDA extension kernels that frameworks build at first use: their math in torch ops.

Each function here has the name, arguments, checks and in-place effects of one function of
a just-in-time built CUDA extension (`accel.sim.cuda.torch_cuda.extensions` hands them out in place of
the compiled module): DeepSpeed's fused optimizers, which its default configs use.

* `multi_tensor_adam`: DeepSpeed's (apex's) FusedAdam kernel. Mode 1 is AdamW (decoupled
  weight decay), mode 0 Adam with L2 weight decay added to the gradient; bias correction
  on or off; math in float32 for every parameter dtype, as the kernel does.
* `lamb`: DeepSpeed's FusedLamb kernel (one parameter per call): the Adam moments, the
  trust ratio ||w|| / ||update|| clamped to [min_coeff, max_coeff], and the coefficient
  returned as a 1-element tensor on the GPU.
* `multi_tensor_lion`: DeepSpeed's FusedLion kernel.

A fused kernel allocates nothing on the GPU: these compute on the CPU tensors under the
simulated ones (`accel.sim.cuda.tensors.cuda_tensor.unwrap`), so memory is counted as on the card (the
few buffers a kernel does allocate are allocated on the simulated GPU). With shapes only,
tensors without data are left as they are (their values mean nothing).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from accel.sim.core import device_rules
from accel.sim.cuda.tensors.cuda_tensor import unwrap

_MULTI_TENSOR_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _f32(value: float) -> float:
    """`value` rounded to float32, as a kernel argument declared `float` receives it."""
    return ctypes.c_float(value).value


def _not_implemented(kernel: str, dtype: torch.dtype) -> RuntimeError:
    return RuntimeError(f"\"{kernel}\" not implemented for '{device_rules.SCALAR_NAMES.get(dtype, str(dtype))}'")


def _check_tensor_lists(kernel: str, tensor_lists: Any, depth: int) -> None:
    """The checks of the multi-tensor-apply launcher, with its messages (lists, device, layout, sizes, dtype)."""
    if len(tensor_lists) != depth:
        raise RuntimeError("tensor_lists.size() != depth")
    if len(tensor_lists[0]) == 0:
        raise RuntimeError("tensor_lists[0].size() is not > 0")
    reference = tensor_lists[0][0].device
    if reference.type != "cuda":
        raise RuntimeError("expected input to be on cuda")
    for tensors in tensor_lists:
        if len(tensors) != len(tensor_lists[0]):
            raise RuntimeError("Size mismatch among tensor lists")
        for tensor, first in zip(tensors, tensor_lists[0], strict=True):
            if not (tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last)):
                raise RuntimeError("A tensor was not contiguous.")
            if tensor.device != reference:
                raise RuntimeError("A tensor was not on the same device as the first tensor")
            if tensor.numel() != first.numel():
                raise RuntimeError("Size mismatch")
    if tensor_lists[0][0].dtype not in _MULTI_TENSOR_DTYPES:
        raise _not_implemented(kernel, tensor_lists[0][0].dtype)


def _float_views(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """The CPU tensors under `tensors` in float32 (the same tensors when already float32), or None with shapes only."""
    inner = [unwrap(t) for t in tensors]
    if any(t.is_meta for t in inner):
        return None
    return [t if t.dtype == torch.float32 else t.float() for t in inner]


def _store(tensors: tuple[torch.Tensor, ...], results: list[torch.Tensor]) -> None:
    """Write float32 results back into `tensors` where they were computed in a copy (other dtypes)."""
    for tensor, result in zip(tensors, results, strict=True):
        inner = unwrap(tensor)
        if inner is not result:
            inner.copy_(result)


def multi_tensor_adam(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """One Adam step on lists [grads, params, exp_avgs, exp_avg_sqs], in place (mode 1: AdamW, 0: L2 decay).

    The kernel reads everything in float32 and writes parameters and moments back in their
    dtype; gradients are left unchanged. `chunk_size` and `noop_flag` only steer its launch.
    """
    _check_tensor_lists("adam", tensor_lists, 4)
    lr, beta1, beta2, epsilon, decay = (_f32(x) for x in (lr, beta1, beta2, epsilon, weight_decay))
    correction1 = _f32(1 - beta1**step) if bias_correction == 1 else 1.0
    correction2 = _f32(1 - beta2**step) if bias_correction == 1 else 1.0
    with torch.no_grad():
        for tensors in zip(*tensor_lists, strict=True):
            views = _float_views(*tensors)
            if views is None:
                continue
            grad, param, exp_avg, exp_avg_sq = views
            if mode == 0:
                grad = grad.add(param, alpha=decay)  # L2: the decay joins the gradient the moments see
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            update = (exp_avg / correction1).div_((exp_avg_sq / correction2).sqrt_().add_(epsilon))
            if mode != 0:
                update.add_(param, alpha=decay)  # decoupled: the decay joins the update
            param.add_(update, alpha=-lr)
            _store(tensors[1:], [param, exp_avg, exp_avg_sq])


def multi_tensor_lion(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    step: int,
    weight_decay: float,
) -> None:
    """One Lion step on lists [grads, params, exp_avgs], in place.

    The update is -lr where beta1 * m + (1 - beta1) * g is positive and +lr elsewhere (zero
    included, as in the kernel), after the parameter decays by 1 - lr * weight_decay.
    """
    _check_tensor_lists("lion", tensor_lists, 3)
    lr, beta1, beta2, decay = (_f32(x) for x in (lr, beta1, beta2, weight_decay))
    with torch.no_grad():
        for tensors in zip(*tensor_lists, strict=True):
            views = _float_views(*tensors)
            if views is None:
                continue
            grad, param, exp_avg = views
            direction = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1)
            update = torch.full_like(direction, lr).masked_fill_(direction > 0, -lr)
            param.mul_(_f32(1 - lr * decay)).add_(update)
            exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
            _store(tensors[1:], [param, exp_avg])


def _check_lamb_inputs(
    p: torch.Tensor, p_copy: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor
) -> None:
    """The kernel's input checks, with its messages."""
    named = {"p": p, "m": m, "v": v, "g": g}
    if p_copy.numel() > 0:
        named["p_copy"] = p_copy
    for name, tensor in named.items():
        if not tensor.is_cuda:
            raise RuntimeError(f"{name} must be a CUDA tensor")
        if not tensor.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
    for name in ("m", "v", "g"):
        if named[name].numel() != p.numel():
            raise RuntimeError(f"number of elements in {name} and p tensors should be equal")
    if p_copy.numel() not in (0, p.numel()):
        raise RuntimeError("number of elements in p_copy and p tensors should be equal, or p_copy should be empty")
    if g.dtype == torch.float16 and p.dtype != torch.float32:
        raise RuntimeError("expected parameter to be of float type")
    if g.dtype not in (torch.float16, torch.float32, torch.float64):
        raise _not_implemented("lamb_cuda_kernel", g.dtype)


def _lamb_coefficient(weight_norm: float, update_norm: float, max_coeff: float, min_coeff: float) -> float:
    """The trust ratio ||w|| / ||update||, clamped as the kernel clamps it (1 when either norm is 0)."""
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    coefficient = _f32(weight_norm / update_norm)
    if coefficient > max_coeff:
        coefficient = max_coeff
    if coefficient < min_coeff:
        coefficient = min_coeff
    return coefficient


def lamb(
    p: torch.Tensor,
    p_copy: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    max_coeff: float,
    min_coeff: float,
    eps: float,
    grad_scale: float,
    step: int,
    mode: int,
    bias_correction: int,
    decay: float,
) -> torch.Tensor:
    """One LAMB step on one parameter, in place; returns the trust ratio as a 1-element tensor on its GPU.

    Mode 0 puts eps under the square root, mode 1 outside. With fp16 gradients the parameter
    and moments are float32 and `p_copy` (if not empty) receives the new parameter in fp16.
    """
    _check_lamb_inputs(p, p_copy, m, v, g)
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    # the kernel's buffers on the GPU: two for the norms' partial sums, one for the coefficient
    partial_sums = (torch.empty(512, dtype=dtype, device=p.device), torch.empty(512, dtype=dtype, device=p.device))
    coefficient = torch.empty(1, dtype=dtype, device=p.device)
    beta1, beta2, eps, grad_scale, decay = (_f32(x) for x in (beta1, beta2, eps, grad_scale, decay))
    step_size = _f32(lr)
    if bias_correction == 1:  # both corrections folded into the step size, as the kernel does
        step_size = _f32(step_size * math.sqrt(_f32(1 - beta2**step)) / _f32(1 - beta1**step))
    inner = [unwrap(t) for t in (p, m, v, g)]
    value = 1.0
    if not any(t.is_meta for t in inner):
        with torch.no_grad():
            param, exp_avg, exp_avg_sq, grad = inner
            scaled = grad.to(dtype) / grad_scale
            exp_avg.mul_(beta1).add_(scaled, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(scaled, scaled, value=1 - beta2)
            denom = exp_avg_sq.add(eps).sqrt_() if mode == 0 else exp_avg_sq.sqrt().add_(eps)
            update = (exp_avg / denom).add_(param, alpha=decay)
            norms = (param.square().sum().sqrt().item(), update.square().sum().sqrt().item())
            value = _lamb_coefficient(*norms, max_coeff, min_coeff)
            param.add_(update, alpha=-(step_size * value))
            if p_copy.numel() > 0 and g.dtype == torch.float16:
                unwrap(p_copy).copy_(param)
    unwrap(coefficient).fill_(value)
    del partial_sums  # freed when the kernel returns
    return coefficient
