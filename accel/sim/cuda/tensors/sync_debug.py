"""`torch.cuda.set_sync_debug_mode` on simulated GPUs: the host's waits for the GPU, reported.

On a GPU host, "warn" makes every operation that makes the host wait for the GPU warn
"called a synchronizing CUDA operation", and "error" raises it (c10/cuda's
`warn_or_error_on_sync`): reading a value (`.item()`, `.tolist()`, `if t:`), blocking
copies between host and GPU (`.cpu()`, `.to("cuda")` from pageable memory), ops whose output
size depends on the data (`nonzero`, `masked_select`, `unique`, boolean-mask indexing,
`repeat_interleave` without `output_size`, `bincount`, `equal`), and `Stream.synchronize()`.
People turn it on to find the syncs that stall a training step; here the same calls are
reported, so a test can assert a step has none. Explicit `torch.cuda.synchronize()` and
`Event.synchronize()` are not reported (nor are they on the card).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

_MODES = {"default": 0, "warn": 1, "error": 2}
_mode = [0]
MESSAGE = "called a synchronizing CUDA operation"


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """`torch.cuda.set_sync_debug_mode`: 0/"default" off, 1/"warn" warn, 2/"error" raise."""
    if isinstance(debug_mode, str):
        if debug_mode not in _MODES:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _MODES[debug_mode]
    _mode[0] = int(debug_mode)


def get_sync_debug_mode() -> int:
    return _mode[0]


#: called where the host waits for the current GPU's current stream (the clock of `accel.sim.cuda.timing`
#: names itself here, from the room above)
on_wait: list[Callable[[], None]] = []


#: called before the host waits for the GPU: filled while a CUDA graph is captured, which refuses it
#: (`torch_cuda.graphs`)
before_wait: list[Callable[[], None]] = []


def synchronizing(stacklevel: int = 3) -> None:
    """The host waits for the GPU here: warn or raise as the mode asks (nothing when it is off)."""
    for check in before_wait:
        check()
    mode = _mode[0]
    if mode == 1:
        warnings.warn(MESSAGE, UserWarning, stacklevel=stacklevel)
    elif mode >= 2:
        raise RuntimeError(MESSAGE)


def waiting() -> None:
    """The host waits for the current GPU's current stream to read a value back: the clock waits, the mode reports."""
    for callback in on_wait:
        callback()
    synchronizing(stacklevel=4)


def blocking_copy(kwargs: dict, args: tuple = (), position: int = 2) -> None:
    """A copy between host and GPU: it makes the host wait unless it is asked not to block."""
    blocks = not (args[position] if len(args) > position else kwargs.get("non_blocking", False))
    if (_mode[0] or before_wait) and blocks:
        synchronizing()


def _masks_by_value(args: tuple, kwargs: dict) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _size_not_given(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("output_size") is None


#: ops whose output size the host learns from the GPU, with the condition under which they do
_DATA_SIZED: dict[Any, Any] = {
    aten.nonzero.default: None,
    aten.masked_select.default: None,
    aten._unique.default: None,
    aten._unique2.default: None,
    aten.unique_dim.default: None,
    aten.unique_consecutive.default: None,
    aten.bincount.default: None,
    aten.equal.default: None,
    aten.index.Tensor: _masks_by_value,
    aten.index_put_.default: _masks_by_value,
    aten.index_put.default: _masks_by_value,
    aten.repeat_interleave.Tensor: _size_not_given,
}


def checks() -> dict[Any, Any]:
    """op -> `check(args, kwargs)`, run before the op: reports the data-sized ops' wait for the GPU."""

    def check(condition: Any) -> Any:
        def run(args: tuple, kwargs: dict) -> None:
            if (_mode[0] or on_wait or before_wait) and (condition is None or condition(args, kwargs)):
                waiting()

        return run

    return {func: check(condition) for func, condition in _DATA_SIZED.items()}
