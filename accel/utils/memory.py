"""Releasing memory between experiments (e.g. before retrying with a smaller batch)."""

from __future__ import annotations

import gc
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


def free_memory(*objects: Any, hardware: Any = None) -> list[None]:
    """Drop the references passed in, collect garbage and release cached device memory.

    Returns a list of `None` of the same length so callers can write
    `model, optimizer = free_memory(model, optimizer)` to drop their own references.
    """
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    gc.collect()
    release_device_cache(hardware)
    return objects
