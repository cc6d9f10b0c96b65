"""`scaled_dot_product_attention` on simulated GPUs takes a fused kernel, as on a GPU.

torch picks the attention kernel by device type in C++ (flash / memory-efficient on CUDA,
the CPU's flash kernel on the CPU) and falls back to its math decomposition for a device
it does not know, such as the hidden one under simulated GPUs. The math path gives other
numbers than the CPU, and DTensor has no sharding rules for the ops it decomposes into (a
tensor-parallel attention then fails with "got mixed torch.Tensor and DTensor"). So, for
tensors on a simulated GPU, attention without a mask or dropout runs as GPU attention
does: through `_scaled_dot_product_flash_attention` (whose autograd formula and DTensor
rules torch has), computed by the CPU's flash kernel; otherwise torch's math path.

Installed once per simulated GPU rank (`accel.sim.cuda.fake.install`).
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.cuda.tensor import unwrap, wrap_like

aten = torch.ops.aten
_libraries: list[torch.library.Library] = []


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if attn_mask is None and not dropout_p and not enable_gqa and query.dim() == 4 and _flash_capable():
        return aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, scale=scale)[0]
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _flash_capable() -> bool:
    """Whether the simulated card has flash attention: torch's CUDA build needs sm_80 or newer for it."""
    from accel.sim.cuda import properties as cuda_properties

    return cuda_properties.model().capability >= (8, 0)


def _flash(args: tuple, kwargs: dict) -> Any:
    """`_scaled_dot_product_flash_attention` of simulated CUDA tensors: the CPU's flash kernel."""
    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else 0.0
    is_causal = args[4] if len(args) > 4 else False
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
        unwrap(query), unwrap(key), unwrap(value), dropout_p, is_causal, scale=kwargs.get("scale")
    )

    # The CUDA op's other outputs mean nothing without variable lengths or dropout: sequence
    # offsets and RNG state as 0-dim tensors (what DTensor accepts without a sharding), no debug mask.
    def nothing(dtype: torch.dtype) -> torch.Tensor:
        return wrap_like(torch.zeros((), dtype=dtype), query)

    return (
        wrap_like(out, query),
        wrap_like(logsumexp, query),
        nothing(torch.int32),
        nothing(torch.int32),
        query.shape[2],
        key.shape[2],
        nothing(torch.int64),
        nothing(torch.int64),
        wrap_like(torch.empty(0, dtype=query.dtype), query),
    )


def _flash_backward(args: tuple, kwargs: dict) -> Any:
    """Its backward: the CPU's flash backward kernel."""
    grad_out, query, key, value, out, logsumexp = (unwrap(t) for t in args[:6])
    dropout_p, is_causal = args[10], args[11]
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=kwargs.get("scale")
    )
    return tuple(wrap_like(grad, args[1]) for grad in grads)


def handlers() -> dict[Any, Any]:
    """The flash attention ops -> their handlers on simulated CUDA tensors (`cuda_tensor.add_special`)."""
    return {
        aten._scaled_dot_product_flash_attention.default: _flash,
        aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    }


def install() -> None:
    """Route attention on the hidden device through the flash op (once per process)."""
    if _libraries:
        return
    library = torch.library.Library("aten", "IMPL")  # kept alive in _libraries
    library.impl("scaled_dot_product_attention", _attention, "AutogradPrivateUse1")
    _libraries.append(library)
