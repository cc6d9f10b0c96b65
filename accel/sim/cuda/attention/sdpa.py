"""`scaled_dot_product_attention` on simulated GPUs: the backend the card would run, with that backend's memory.

Torch picks the attention kernel in C++ by device type, and for a device it does not know,
such as the hidden one under simulated GPUs, takes its math decomposition: an L x S score
matrix per head (per query head, with the key and value heads repeated, for grouped-query
attention), where a GPU runs a fused kernel and holds a fraction of that. So, for tensors on
a simulated GPU, this module does what torch's composite does on CUDA (`scaled_dot_product_attention`
in aten/src/ATen/native/transformers/attention.cpp): it checks the inputs, picks the backend
the simulated card would (`accel.sim.cuda.attention.backends`: capability, dtypes, head
dims, mask, dropout, grouped-query heads, the `sdpa_kernel` / `enable_*_sdp` switches),
prepares the arguments as torch does for that backend (boolean masks made additive, the
memory-efficient kernel's bias padded to 8 and broadcast, flash's head dim padded to a
multiple of 8) and calls the backend's op, whose autograd formula and DTensor rules torch
has; `accel.sim.cuda.attention.kernels` computes those ops on the host and takes their
memory as the CUDA kernels do. The math backend runs torch's own decomposition, as on a GPU.
Nested inputs take that decomposition too (their fused paths are not simulated).

The route is registered for autograd on the hidden device, and handles the composite op
where it arrives whole below autograd (inference mode). Installed once per simulated GPU
rank (`accel.sim.cuda.fake.install`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from accel.sim.cuda.attention import backends, kernels, varlen
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.tensors import cuda_tensor

aten = torch.ops.aten
_libraries: list[torch.library.Library] = []

#: how c10 names dtypes in the messages of `validate_sdpa_input`
_C10_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.int32: "int",
    torch.int64: "long int",
    torch.int16: "short int",
    torch.int8: "signed char",
    torch.uint8: "unsigned char",
    torch.bool: "bool",
}


def route(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`scaled_dot_product_attention` of tensors on a simulated GPU, through the backend the card picks."""
    _validate(query, key, value, attn_mask)
    if any(t.is_nested for t in (query, key, value)):
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    call = backends.Call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    _watch_starts()
    choice = backends.choose(call, card())
    if choice == backends.FLASH:
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if choice == backends.EFFICIENT:
        return _efficient(call, scale)
    if choice == backends.CUDNN:
        bias = _additive(attn_mask, query.dtype, -65504.0)  # cuDNN takes a finite fill (its -inf issue)
        args = (query, key, value, bias, _wants_lse(call), dropout_p, is_causal, False)
        return aten._scaled_dot_product_cudnn_attention.default(*args, scale=scale)[0]
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def card() -> backends.Card:
    """The simulated card, as the backend checks see it."""

    model = cuda_memory.card()
    return backends.Card(model.major, model.minor)


#: the simulated GPUs whose CUDA starts begin a new life of the process (each test a rank runs)
_watched: list[Any] = []


def _watch_starts() -> None:
    """Have each CUDA start of this rank's simulated GPUs begin a new life for the backend choice."""

    gpus = cuda_state.gpus()
    if any(seen is gpus for seen in _watched):
        return
    if _watched:
        backends.new_life()  # GPUs set up anew
    _watched.append(gpus)
    gpus.on_start.append(lambda _: backends.new_life())


def _validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Torch's checks before any backend is picked (`validate_sdpa_input`), with its messages."""
    q, k, v = query, key, value
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{_c10(q.dtype)} key.dtype: {_c10(k.dtype)} and value.dtype: {_c10(v.dtype)} instead."
        )
    if not q.device.type == k.device.type == v.device.type:
        raise RuntimeError(
            "Expected query, key, and value to have the same device type, but got query.device: "
            f"{q.device} key.device: {k.device} and value.device: {v.device} instead."
        )
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise RuntimeError(
            "Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
            f"{q.dim()} key.dim: {k.dim()} and value.dim: {v.dim()} instead."
        )
    if mask is None:
        return
    if mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{_c10(mask.dtype)} and  query.dtype: {_c10(q.dtype)} instead."
        )
    if q.is_nested or k.is_nested:
        raise RuntimeError(
            "Scaled_dot_product_attention: Nested tensors for query / key are not supported when an explicit "
            "attn_mask is set"
        )


def _c10(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _math(*args: Any) -> torch.Tensor:
    """Torch's own composite, which takes its math path on the hidden device, as a GPU does when it picks math."""
    query, key, value, mask, dropout_p, is_causal, scale, enable_gqa = args
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _wants_lse(call: backends.Call) -> bool:
    # the fused forwards keep the logsumexp only for a backward (`should_compute_logsumexp`)
    return torch.is_grad_enabled() and any(t.requires_grad for t in call.tensors)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, fill: float) -> torch.Tensor | None:
    """A boolean mask as the additive one the fused kernels take (`convert_boolean_attn_mask`); others as given."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device), fill)


def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """Flash, as the composite calls it on CUDA: head dims padded to a multiple of 8, the output cut back."""
    head_dim = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)  # the scale of the head dim before padding
    padded = [_pad_last(t, 8) for t in (query, key, value)]
    out = aten._scaled_dot_product_flash_attention.default(*padded, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if out.shape[-1] != head_dim else out


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    size = t.shape[-1]
    if size % multiple == 0:
        return t
    return aten.constant_pad_nd.default(t, [0, multiple - size % multiple])


def _efficient(call: backends.Call, scale: float | None) -> torch.Tensor:
    """Memory-efficient attention, with the bias laid out as its kernel needs it (`preprocess_mask`)."""
    query, key, value = call.tensors
    bias = _additive(call.attn_mask, query.dtype, float("-inf"))
    if bias is not None:
        aligned = bias.stride(-1) == 1 and all(s % 8 == 0 for s in bias.stride()[:-1])
        if not aligned:  # padded by a full 8 when only the strides are off, as torch does
            last = bias.shape[-1]
            bias = aten.constant_pad_nd.default(bias, [0, 8 - last % 8])[..., :last]
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    args = (query, key, value, bias, _wants_lse(call), call.dropout_p, call.is_causal)
    return aten._scaled_dot_product_efficient_attention.default(*args, scale=scale)[0]


def handlers() -> dict[Any, Any]:
    """The attention ops -> their handlers on simulated CUDA tensors (`cuda_tensor.add_special`).

    The composite itself comes here below autograd (inference mode): it takes the same route.
    """
    forwards = {
        aten._scaled_dot_product_flash_attention.default: kernels.flash_forward,
        aten._scaled_dot_product_efficient_attention.default: kernels.efficient_forward,
        aten._scaled_dot_product_cudnn_attention.default: kernels.cudnn_forward,
        aten._flash_attention_forward.default: varlen.flash_forward,  # varlen_attn, FlashAttention's own op
    }
    return {
        aten.scaled_dot_product_attention.default: lambda args, kwargs: route(*args, **kwargs),
        **{op: functools.partial(_on_one_device, op, handler) for op, handler in forwards.items()},
        aten._scaled_dot_product_flash_attention_backward.default: kernels.flash_backward,
        aten._scaled_dot_product_efficient_attention_backward.default: kernels.efficient_backward,
        aten._scaled_dot_product_cudnn_attention_backward.default: kernels.cudnn_backward,
        aten._flash_attention_backward.default: varlen.flash_backward,
    }


def _on_one_device(op: Any, handler: Any, args: tuple, kwargs: dict) -> Any:
    # the forwards check their arguments' devices as CUDA ops do (a mask left on the host fails so);
    # the backwards, declared `device_check: NoCheck`, take the host RNG seeds

    cuda_tensor.op_device(op, args, kwargs)
    return handler(args, kwargs)


def install() -> None:
    """Route attention on the hidden device through the card's backend (once per process)."""
    if _libraries:
        return
    library = torch.library.Library("aten", "IMPL")  # kept alive in _libraries
    library.impl("scaled_dot_product_attention", route, "AutogradPrivateUse1")
    _libraries.append(library)
