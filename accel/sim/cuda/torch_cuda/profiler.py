"""Profiler calls in a simulated GPU rank: answered as a CUDA build answers them with no profiling tool attached.

Frameworks mark their work for GPU profilers whether or not one is running: DeepSpeed wraps
its forward, backward and step in NVTX ranges, Megatron and Lightning call
`torch.cuda.profiler.start()` / `stop()` or `torch.autograd.profiler.emit_nvtx()`. On a GPU
host with no tool (Nsight, nvprof) attached these calls do nothing and return the values
NVTX and the CUDA runtime return then; a CPU build of torch has neither library and raises
("NVTX functions not installed"). Here:

* `torch.cuda.nvtx` (`range_push`, `range_pop`, `range_start`, `range_end`, `mark`,
  `range`, the device ranges) talks to `Nvtx`, which answers as NVTX does without a tool:
  push and pop return -2 (`NVTX_NO_PUSH_POP_TRACKING`), `range_start` returns range id 0.
* `torch.cuda.cudart()` is `Cudart`: `cudaProfilerStart` / `cudaProfilerStop` succeed, so
  `torch.cuda.profiler.start()`, `stop()` and `profile()` do nothing, as on a GPU host.
* `torch.autograd.profiler.emit_nvtx` turns torch's range-per-op profiler on (so that
  `torch.autograd._profiler_enabled()` is true inside it, as on a GPU host) through torch's
  ITT annotations, which go nowhere without a tool, exactly as NVTX ranges do.
* `torch.profiler` lists CUDA among its activities, as a CUDA build does: a profile that
  asks for CUDA (`torch.profiler.profile`, or the legacy `torch.autograd.profiler.profile`
  with `use_device="cuda"`) records the ops (as CPU ops: a simulated GPU runs no kernels)
  instead of warning at every op that CUDA events cannot be recorded.

Installed once per simulated GPU rank (`accel.sim.cuda.fake.install`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.profiler

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus.errors import SimulatedDeviceError

#: what NVTX's range push and pop return when no tool collects ranges (NVTX_NO_PUSH_POP_TRACKING)
NO_PUSH_POP_TRACKING = -2
#: the range id NVTX's range start returns when no tool collects ranges
NO_RANGE_ID = 0


def _check_arguments(name: str, signature: str, args: tuple, kinds: tuple) -> None:
    """Raise the TypeError torch's C++ binding `name` raises for arguments not of `kinds` (None: any)."""
    for value, kind in zip(args, kinds, strict=True):
        if kind is not None and not isinstance(value, kind):
            shown = ", ".join(repr(a) for a in args)
            raise TypeError(
                f"{name}(): incompatible function arguments. The following argument types are supported:\n"
                f"    1. {signature}\n\nInvoked with: {shown}"
            )


class _DeviceRange:
    """The handle of a device range (`torch.cuda.nvtx._device_range_start`): opaque, as the C++ one is."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class Nvtx:
    """`torch._C._nvtx` of a CUDA build, with no profiling tool attached to collect the ranges.

    NVTX hands each call to the tool that injected itself; without one the call does nothing
    and returns NVTX's answers for "not tracked". Messages must be strings (or None), as the
    C++ binding requires. The methods have the names of torch's binding.
    """

    @staticmethod
    def rangePushA(message: str | None) -> int:
        _check_arguments("rangePushA", "(arg0: str) -> int", (message,), ((str, type(None)),))
        return NO_PUSH_POP_TRACKING

    @staticmethod
    def rangePop() -> int:
        return NO_PUSH_POP_TRACKING

    @staticmethod
    def rangeStartA(message: str | None) -> int:
        _check_arguments("rangeStartA", "(arg0: str) -> int", (message,), ((str, type(None)),))
        return NO_RANGE_ID

    @staticmethod
    def rangeEnd(range_id: int) -> None:
        _check_arguments("rangeEnd", "(arg0: int) -> None", (range_id,), (int,))

    @staticmethod
    def markA(message: str | None) -> None:
        _check_arguments("markA", "(arg0: str) -> None", (message,), ((str, type(None)),))

    @staticmethod
    def deviceRangeStart(message: str, stream: int) -> _DeviceRange:
        _check_arguments("deviceRangeStart", "(arg0: str, arg1: int) -> capsule", (message, stream), (str, int))
        return _DeviceRange(message)

    @staticmethod
    def deviceRangeEnd(handle: Any, stream: int) -> None:
        _check_arguments("deviceRangeEnd", "(arg0: capsule, arg1: int) -> None", (handle, stream), (_DeviceRange, int))


class CudaError(int):
    """`cudaError` of torch's CUDA runtime bindings: an error code; `CudaError.success` is 0."""

    success: CudaError

    def __repr__(self) -> str:
        return "<cudaError.success: 0>" if self == 0 else f"<cudaError.???: {int(self)}>"


CudaError.success = CudaError(0)

#: cudaGetErrorString's words for the codes a program is likeliest to check
_ERROR_STRINGS = {
    0: "no error",
    1: "invalid argument",
    2: "out of memory",
    3: "initialization error",
    100: "no CUDA-capable device is detected",
    101: "invalid device ordinal",
    700: "an illegal memory access was encountered",
}


def _unsupported(call: str, why: str) -> Any:
    """A `Cudart` method that raises `SimulatedDeviceError` naming `call` and `why` it cannot be simulated."""

    def fail(*args: Any, **kwargs: Any) -> Any:

        raise SimulatedDeviceError(f"torch.cuda.cudart().{call} is not available on a simulated GPU: {why}")

    fail.__name__ = call
    return staticmethod(fail)


class Cudart:
    """`torch.cuda.cudart()`: the CUDA runtime calls torch binds, as a GPU host with no profiler attached answers.

    Starting and stopping the profiler succeed and do nothing (no tool collects anything);
    `cudaMemGetInfo` is the simulated GPU's `torch.cuda.mem_get_info`. What works on raw
    addresses (registering host memory, creating streams) raises `SimulatedDeviceError`.
    """

    cudaError = CudaError  # the names are those of torch's binding

    @staticmethod
    def cudaGetErrorString(error: Any) -> str:
        return _ERROR_STRINGS.get(int(error), "unrecognized error code")

    @staticmethod
    def cudaProfilerStart() -> CudaError:
        return CudaError.success

    @staticmethod
    def cudaProfilerStop() -> CudaError:
        return CudaError.success

    @staticmethod
    def cudaMemGetInfo(device: int) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    cudaHostRegister = _unsupported(
        "cudaHostRegister", "it page-locks host memory at a raw address; use Tensor.pin_memory()"
    )
    cudaHostUnregister = _unsupported("cudaHostUnregister", "host memory cannot be registered at a raw address")
    cudaStreamCreate = _unsupported(
        "cudaStreamCreate", "it writes a stream handle to a raw address; use torch.cuda.Stream"
    )
    cudaStreamDestroy = _unsupported("cudaStreamDestroy", "streams come from torch.cuda.Stream")


class EmitNvtx:
    """`torch.autograd.profiler.emit_nvtx`: a range per op, sent to the profiling tool, which is not there.

    On a GPU host with no tool attached the ranges go nowhere, but torch's profiler is on
    inside the block (`torch.autograd._profiler_enabled()`), another profiler cannot start
    in it, and the block synchronises the GPU on entry and exit. Here torch's ITT ranges
    (Intel's equivalent of NVTX, built into CPU builds) carry that behaviour; where a build
    lacks ITT the block only synchronises.
    """

    def __init__(self, enabled: bool = True, record_shapes: bool = False) -> None:
        self.enabled = enabled
        self.entered = False
        self.record_shapes = record_shapes
        self._ranges = torch.autograd.profiler.emit_itt(enabled and torch.profiler.itt.is_available(), record_shapes)

    def __enter__(self) -> EmitNvtx | None:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("NVTX annotation context manager is not reentrant")
        self.entered = True
        torch.cuda.synchronize()
        self._ranges.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        if not self.enabled:
            return None
        torch.cuda.synchronize()
        self._ranges.__exit__(*exc)
        return False


def install() -> None:
    """Answer NVTX, the CUDA runtime's profiler calls, `emit_nvtx` and torch.profiler's activities as a CUDA build."""
    torch_internals.serve_nvtx(Nvtx())
    torch_internals.serve_cudart(Cudart())
    torch.autograd.profiler.emit_nvtx = EmitNvtx  # type: ignore[misc,assignment]  # simulated ranks only
    torch_internals.list_cuda_profiler_activity()
    torch_internals.profile_legacy_cuda_through_kineto()
