"""`torch.autocast(<shown type>)` on a simulated device: the real device's policy, applied by Python kernels.

The wrapper tensors sit on the hidden PrivateUse1 device, whose autocast key gets one
Python kernel per op of the device's policy: "lower" ops run in the autocast dtype,
"fp32" ops in float32, "fp32_opt" ops get `dtype=float32` when none was given, "promote"
ops run in the widest dtype of their inputs. Entering `torch.autocast(<shown type>)` also
turns the hidden device's autocast on with the same dtype; everything else falls through
its key. Only the device's own floating tensors are cast, as the real autocast does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from accel.sim.core import torch_internals

aten = torch.ops.aten


class Autocast:
    """The autocast of one simulated device: `policy` maps "lower"/"fp32"/"fp32_opt"/"promote" to [(op, overload)]."""

    def __init__(self, shown: str, hidden: str, tensor_type: type) -> None:
        self.shown = shown
        self.hidden = hidden
        self.tensor_type = tensor_type
        #: leaf tensor id -> (tensor, its cast copy), like autocast's weight cache
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._libraries: list[torch.library.Library] = []

    def _castable(self, value: Any) -> bool:
        return (
            type(value) is self.tensor_type
            and isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dtype != torch.float64
        )

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(item, dtype) for item in value)
        if not self._castable(value) or value.dtype == dtype:
            return value
        cacheable = value.is_leaf and value.requires_grad and torch.is_autocast_cache_enabled()
        if cacheable:
            hit = self.cache.get(id(value))
            if hit is not None and hit[0] is value and hit[1].dtype == dtype:
                return hit[1]
        out = value.to(dtype)
        if cacheable:
            self.cache[id(value)] = (value, out)
        return out

    def _widest(self, args: tuple, kwargs: dict) -> torch.dtype | None:
        dtypes = [a.dtype for a in (*args, *kwargs.values()) if self._castable(a)]
        for value in args:
            if isinstance(value, (list, tuple)):
                dtypes.extend(item.dtype for item in value if self._castable(item))
        return functools.reduce(torch.promote_types, dtypes) if dtypes else None

    def _kernel(self, policy: str, op: Any) -> Callable[..., Any]:
        names = [a.name for a in op._schema.arguments]
        dtype_at = names.index("dtype") if "dtype" in names else None
        hidden = self.hidden

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch_internals.autocast_key_guard():
                dtype: torch.dtype | None = None
                if policy == "lower":
                    dtype = torch.get_autocast_dtype(hidden)
                elif policy == "fp32":
                    dtype = torch.float32
                elif policy == "promote":
                    dtype = self._widest(args, kwargs)
                elif args and self._castable(args[0]):  # fp32_opt: float32 output unless a dtype was given
                    if dtype_at is not None and len(args) > dtype_at:
                        if args[dtype_at] is None:
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs = dict(kwargs, dtype=torch.float32)
                if dtype is not None:
                    args = self._cast(args, dtype)
                    kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
                return op(*args, **kwargs)

        return kernel

    def install(self, policy: dict[str, list[tuple[str, str]]]) -> int:
        """Register the policy on the hidden device's autocast key; returns how many ops it covers."""
        if self._libraries:
            return 0
        kernels = torch.library.Library("aten", "IMPL")
        count = 0
        for name, ops in policy.items():
            for op_name, overload in ops:
                op = getattr(getattr(aten, op_name, None), overload, None)
                if op is None:
                    continue  # listed for a build with extra ops
                kernels.impl(op, self._kernel(name, op), "AutocastPrivateUse1")
                count += 1
        fallthrough = torch.library.Library("_", "IMPL")
        fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        self._libraries.extend([kernels, fallthrough])
        self._follow_context()
        return count

    def _follow_context(self) -> None:
        # torch.autocast(<shown>) must also switch the hidden device's autocast on and off.
        context = torch.amp.autocast_mode.autocast
        enter, exit_ = context.__enter__, context.__exit__
        hidden, shown, cache = self.hidden, self.shown, self.cache

        def __enter__(self: Any) -> Any:
            result = enter(self)
            if self.device == shown:
                self._accel_sim_previous = (torch.is_autocast_enabled(hidden), torch.get_autocast_dtype(hidden))
                torch.set_autocast_enabled(hidden, self._enabled)
                torch.set_autocast_dtype(hidden, self.fast_dtype)
            return result

        def __exit__(self: Any, *exc: Any) -> Any:
            result = exit_(self, *exc)
            previous = getattr(self, "_accel_sim_previous", None)
            if self.device == shown and previous is not None:
                torch.set_autocast_enabled(hidden, previous[0])
                torch.set_autocast_dtype(hidden, previous[1])
                if not previous[0]:
                    cache.clear()
            return result

        context.__enter__ = __enter__  # type: ignore[method-assign]  # wraps the original
        context.__exit__ = __exit__  # type: ignore[method-assign]  # wraps the original

    def reset(self) -> None:
        """Between tests: autocast off on the device, its cache empty."""
        torch.set_autocast_enabled(self.shown, False)
        torch.set_autocast_enabled(self.hidden, False)
        self.cache.clear()
