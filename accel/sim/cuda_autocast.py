"""`torch.autocast("cuda")` on simulated GPUs: CUDA's policy, applied by Python kernels.

CUDA's autocast kernels are compiled into the CUDA library, which a CPU-only build does
not have. The simulated tensors sit on the PrivateUse1 device, whose autocast key we
give one Python kernel per op of CUDA's lists (read from the header torch ships, see
`torch_internals.autocast_op_lists`): "lower" ops run in the autocast dtype, "fp32" ops
in float32, "fp32_opt" ops get `dtype=float32` when none was given, "promote" ops run
in the widest dtype of their inputs. Entering `torch.autocast("cuda")` also turns the
PrivateUse1 autocast on with the same dtype; everything else falls through its key.
Only simulated CUDA tensors are cast, as CUDA's autocast only casts CUDA tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from accel.sim import cuda_state
from accel.sim.core import torch_internals
from accel.sim.cuda_tensor import SimCudaTensor

aten = torch.ops.aten
_libraries: list[torch.library.Library] = []
#: leaf tensor id -> (tensor, its cast copy), like autocast's weight cache
_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _castable(value: Any) -> bool:
    return type(value) is SimCudaTensor and value.is_floating_point() and value.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    if not _castable(value) or value.dtype == dtype:
        return value
    cacheable = value.is_leaf and value.requires_grad and torch.is_autocast_cache_enabled()
    if cacheable:
        hit = _cache.get(id(value))
        if hit is not None and hit[0] is value and hit[1].dtype == dtype:
            return hit[1]
    out = value.to(dtype)
    if cacheable:
        _cache[id(value)] = (value, out)
    return out


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    dtypes = [a.dtype for a in (*args, *kwargs.values()) if _castable(a)]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None


def _kernel(policy: str, op: Any) -> Callable[..., Any]:
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype") if "dtype" in names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch_internals.autocast_key_guard():
            dtype: torch.dtype | None = None
            if policy == "lower":
                dtype = torch.get_autocast_dtype(cuda_state.HIDDEN_DEVICE)
            elif policy == "fp32":
                dtype = torch.float32
            elif policy == "promote":
                dtype = _widest(args, kwargs)
            elif args and _castable(args[0]):  # fp32_opt: float32 output unless a dtype was given
                if dtype_at is not None and len(args) > dtype_at:
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
            if dtype is not None:
                args = _cast(args, dtype)
                kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


def _patch_autocast_context() -> None:
    # torch.autocast("cuda") must also switch the hidden device's autocast on and off.
    context = torch.amp.autocast_mode.autocast
    enter, exit_ = context.__enter__, context.__exit__
    hidden = cuda_state.HIDDEN_DEVICE

    def __enter__(self: Any) -> Any:
        result = enter(self)
        if self.device == "cuda":
            self._accel_sim_previous = (torch.is_autocast_enabled(hidden), torch.get_autocast_dtype(hidden))
            torch.set_autocast_enabled(hidden, self._enabled)
            torch.set_autocast_dtype(hidden, self.fast_dtype)
        return result

    def __exit__(self: Any, *exc: Any) -> Any:
        result = exit_(self, *exc)
        previous = getattr(self, "_accel_sim_previous", None)
        if self.device == "cuda" and previous is not None:
            torch.set_autocast_enabled(hidden, previous[0])
            torch.set_autocast_dtype(hidden, previous[1])
            if not previous[0]:
                _cache.clear()
        return result

    context.__enter__ = __enter__  # type: ignore[method-assign]  # wraps the original
    context.__exit__ = __exit__  # type: ignore[method-assign]  # wraps the original


def install() -> int:
    """Register CUDA's autocast policy for simulated GPUs; returns how many ops it covers."""
    if _libraries:
        return 0
    kernels = torch.library.Library("aten", "IMPL")
    count = 0
    for policy, ops in torch_internals.autocast_op_lists().items():
        for name, overload in ops:
            op = getattr(getattr(aten, name, None), overload, None)
            if op is None:
                continue  # listed for a build with extra ops (e.g. cuDNN-only ones)
            kernels.impl(op, _kernel(policy, op), "AutocastPrivateUse1")
            count += 1
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _libraries.extend([kernels, fallthrough])
    _patch_autocast_context()
    return count


def reset() -> None:
    """Between tests: autocast off on the simulated GPUs, its cache empty."""
    torch.set_autocast_enabled("cuda", False)
    torch.set_autocast_enabled(cuda_state.HIDDEN_DEVICE, False)
    _cache.clear()
