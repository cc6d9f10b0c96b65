"""RMSNorm on a simulated GPU as on a GPU: `rms_norm` runs CUDA's fused kernel, `_fused_rms_norm`.

On a CUDA device torch's `rms_norm` calls `_fused_rms_norm` (one kernel that returns the output and
the fp32 reciprocal standard deviation; its backward, `FusedRmsNormBackward0`, keeps the input and
that rstd); on the host it is written out in ops (pow, mean, add_, rsqrt, mul), which keep more for
backward, launch more kernels, and which DTensor cannot shard the same way (an in-place add on a
partial mean). The choice is made in C++ by device type, where a simulated GPU is its hidden device,
so here: `rms_norm` of a tensor shown on a GPU calls `_fused_rms_norm` (a kernel at its autograd
key, so DTensors take it too), and the fused ops compute on the host what torch's decompositions
compute, their results taken from the simulated GPU's memory.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.cuda.tensors.cuda_tensor import host_tensors, wrap_like

aten = torch.ops.aten

#: the registration of `rms_norm`'s kernel, kept alive for the process
_libraries: list[torch.library.Library] = []


def _rms_norm(input: torch.Tensor, normalized_shape: Any, weight: Any = None, eps: Any = None) -> torch.Tensor:
    """`rms_norm` at the hidden device's autograd key: CUDA's fused kernel for tensors shown on a GPU."""
    if input.is_cuda:
        return aten._fused_rms_norm.default(input, [int(s) for s in normalized_shape], weight, eps)[0]
    return aten.rms_norm.default.decompose(input, normalized_shape, weight, eps)


def forward(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`_fused_rms_norm` (input, normalized_shape, weight, eps) -> (output, rstd in fp32)."""
    input, shape = args[0], args[1]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    host_input, host_weight = host_tensors(input, weight)
    out, rstd = aten._fused_rms_norm.default.decompose(host_input, shape, host_weight, eps)
    return wrap_like(out, input), wrap_like(rstd, input)


def backward(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`_fused_rms_norm_backward` (grad_out, input, normalized_shape, rstd, weight, output_mask)."""
    grad_out, input, shape, rstd, weight, mask = args
    host = host_tensors(grad_out, input, rstd, weight)
    rule = torch_internals.decomposition(aten._fused_rms_norm_backward.default)
    grads = rule(host[0], host[1], shape, host[2], host[3], mask)
    return tuple(wrap_like(g, input) if isinstance(g, torch.Tensor) else None for g in grads)  # type: ignore[return-value]


def handlers() -> dict[Any, Any]:
    """The fused RMSNorm ops -> their handlers on simulated CUDA tensors (`cuda_tensor.add_special`); `rms_norm`
    itself too, for calls below autograd (inference mode)."""
    return {
        aten._fused_rms_norm.default: forward,
        aten._fused_rms_norm_backward.default: backward,
        aten.rms_norm.default: lambda args, kwargs: _rms_norm(*args, **kwargs),
    }


def install() -> None:
    """`rms_norm` takes the fused kernel on simulated GPUs (once per process)."""
    if _libraries:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("rms_norm", _rms_norm, "AutogradPrivateUse1")
    # a kernel of its own for the hidden device, so that its autograd key takes `FusedRmsNormBackward0`
    # (the Autograd kernel) instead of the host's written-out version (CompositeImplicitAutograd)
    library.impl("_fused_rms_norm", _refuse_unwrapped, "PrivateUse1")
    _libraries.append(library)


def _refuse_unwrapped(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("_fused_rms_norm reached the hidden device without a simulated GPU tensor among its arguments")
