"""Checkpoints of simulated CUDA tensors: saved as `cuda:k`, loaded back on that simulated GPU.

Saving needs nothing here: a simulated tensor pickles itself with its storage's location
recorded as `cuda:k` (`SimCudaTensor.__reduce_ex__`), so the file is what a GPU host
writes, and plain torch on a GPU host loads it. Loading: `install()` registers a
location handler that runs before torch's own CUDA one (which would ask the CUDA
library for memory). It checks the index as a GPU host does, with torch's message,
and marks the loaded storage; torch then rebuilds each tensor through
`torch._utils._rebuild_tensor`, which wraps tensors of marked storages. `map_location`
works unchanged: it renames the location before the handler sees it ("cpu" gives CPU
tensors, "cuda:1" or `{"cuda:0": "cuda:1"}` moves them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.serialization

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.tensors.cuda_tensor import SimCudaTensor

#: attribute marking a loaded storage as belonging to a simulated GPU
_MARK = "_accel_sim_cuda_device"
_installed: list[bool] = []


def _restore(storage: Any, location: str) -> Any:
    """torch.load's location handler: keep the data on the host, remember the GPU."""
    if not (isinstance(location, str) and location.startswith("cuda")):
        return None
    device = torch.device(location)
    gpus = cuda_state.gpus()
    index = gpus.current if device.index is None else device.index
    if index >= gpus.count:
        # what torch says on a GPU host with fewer GPUs than the checkpoint names
        raise RuntimeError(
            f"Attempting to deserialize object on CUDA device {index} but torch.cuda.device_count() is "
            f"{gpus.count}. Please use torch.load with map_location to map your storages to an existing device."
        )
    setattr(storage, _MARK, gpus.devices[index])
    return storage


def _rebuild(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any) -> torch.Tensor:
        tensor = original(storage, storage_offset, size, stride)
        device = getattr(getattr(storage, "_untyped_storage", None), _MARK, None)
        return SimCudaTensor(tensor, device) if device is not None else tensor

    return rebuild_tensor


def install() -> None:
    """Make `torch.load` put `cuda:k` storages on simulated GPU k (once per process)."""
    if _installed:
        return
    # priority 19: before torch's CUDA handler (20), after the CPU one (10)
    torch.serialization.register_package(19, lambda storage: None, _restore)
    torch_internals.patch_rebuild_tensor(_rebuild)
    _installed.append(True)
