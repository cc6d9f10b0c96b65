"""Releasing memory between experiments, and retrying with a smaller batch after running out of it."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any


def release_device_cache(hardware: Any = None) -> None:
    """Return cached device memory to the system.

    Asks the backend (`empty_cache()`) when it offers that; otherwise empties the CUDA
    caching allocator if CUDA was initialised in this process (a no-op elsewhere).
    """
    empty_cache = getattr(hardware, "empty_cache", None)
    if callable(empty_cache):
        empty_cache()
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Release the device's cached memory (after a `gc.collect()` with `garbage_collection`, which is slow)."""
    if garbage_collection:
        gc.collect()
    release_device_cache(_active_hardware())


def _active_hardware() -> Any:
    from accel.state import PartialState

    return PartialState._shared_state.get("hardware")


def free_memory(*objects: Any, hardware: Any = None) -> list[None]:
    """Drop the references passed in, collect garbage and release cached device memory.

    Returns a list of `None` of the same length so callers can write
    `model, optimizer = free_memory(model, optimizer)` to drop their own references.
    """
    released: list[None] = [None] * len(objects)
    del objects  # our own references go before collecting, so that what only we held is freed now
    gc.collect()
    release_device_cache(hardware if hardware is not None else _active_hardware())
    return released


def release_memory(*objects: Any) -> list[None]:
    """Accelerate's name for `free_memory`: `a, b = release_memory(a, b)` drops both and empties the device cache."""
    return free_memory(*objects)


#: messages of the errors that mean "this batch does not fit": retry with a smaller one
OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",  # CUDA, ROCm, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # what cuDNN says when a batch is too large for a kernel
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` is an out-of-memory error (of a device or of the CPU) that a smaller batch may avoid."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in OUT_OF_MEMORY_MESSAGES)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call `function(batch_size, *args, **kwargs)`, retrying with a smaller batch after out-of-memory.

    The batch size starts at `starting_batch_size` and is multiplied by 0.9 after each
    out-of-memory error (or set to what `reduce_batch_size_fn()` returns); memory is
    released before each try. Other errors propagate. Reaching 0 raises RuntimeError.
    The caller does not pass the batch size: the decorator does. Usable bare or as
    `@find_executable_batch_size(starting_batch_size=64)`.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def smaller() -> int:
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or smaller

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        free_memory()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            passed = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:], strict=False))
            raise TypeError(
                f"{function.__name__} was called with the batch size as its first argument, but "
                f"find_executable_batch_size passes it itself: call `{function.__name__}({passed})`"
            )
        while True:
            if batch_size <= 0:
                raise RuntimeError(
                    f"find_executable_batch_size: no batch size from {starting_batch_size} down to 1 fits in memory"
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                free_memory()
                batch_size = reduce()

    return decorator
