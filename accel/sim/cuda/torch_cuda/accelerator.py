"""`torch.accelerator` in a simulated GPU rank: the accelerator is CUDA, never the hidden device.

Code written for torch >= 2.6 asks `torch.accelerator` (or `torch.get_device_module()`,
`get_default_backend_for_device`, DeviceMesh, FSDP, DCP, which ask it inside torch) which
device the machine has, and builds its devices, groups and meshes from the answer. C++
knows the simulated GPU as the hidden PrivateUse1 device (`simcuda`); here the Python entry
points torch routes those questions through answer `cuda`, the current simulated GPU, and
`torch.cuda`'s own answers (device count, streams, memory), so that such code takes the
branch it takes on a GPU host and lands on the simulated GPUs.

Also here, because a GPU run prints nothing of the kind: DDP's C++ logger would warn once
per rank that it keeps no time statistics for the hidden device.

Installed once per simulated GPU rank (`accel.sim.cuda.fake.install`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.timing import ops as timing
from accel.sim.cuda.torch_cuda import streams

CUDA = torch.device("cuda")


def _exchange(index: int) -> int:
    """Make GPU `index` current (a negative index changes nothing); the previous current one."""
    previous = cuda_state.gpus().current
    if index >= 0:
        torch.cuda.set_device(index)
    return previous


def _stats(index: int) -> dict[str, Any]:
    """The nested statistics `torch.accelerator.memory_stats` flattens: the simulated allocator's."""
    from accel.sim.cuda.torch_cuda import properties as cuda_properties

    return cuda_properties.memory_stats_as_nested_dict(index)


def _reset_peak(index: int) -> None:
    torch.cuda.reset_peak_memory_stats(index)


def _reset_accumulated(index: int) -> None:
    torch.cuda.reset_accumulated_memory_stats(index)


def answers() -> dict[str, Any]:
    """Name of each private `torch._C` accelerator entry point -> its simulated-GPU answer."""
    return {
        "_get_accelerator": lambda: CUDA,
        "_accelerator_getAccelerator": lambda: CUDA,
        "_accelerator_getDeviceIndex": lambda: cuda_state.gpus().current,
        "_accelerator_setDeviceIndex": lambda index: torch.cuda.set_device(index),
        "_accelerator_exchangeDevice": _exchange,
        "_accelerator_maybeExchangeDevice": _exchange,
        "_accelerator_synchronizeDevice": timing.synchronize,  # work is computed when issued; the clock waits
        "_accelerator_getStream": lambda index: streams.current_stream(index),
        "_accelerator_setStream": streams.set_stream,
        "_accelerator_getDeviceCapability": lambda index: {"supported_dtypes": _supported_dtypes()},
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_emptyCache": lambda: torch.cuda.empty_cache(),
        "_accelerator_emptyHostCache": lambda: None,
        "_accelerator_getDeviceStats": _stats,
        "_accelerator_resetAccumulatedStats": _reset_accumulated,
        "_accelerator_resetPeakStats": _reset_peak,
        "_accelerator_getMemoryInfo": lambda index: torch.cuda.mem_get_info(index),
    }


def _supported_dtypes() -> set[torch.dtype]:
    # every dtype a CUDA tensor can hold: the simulated GPU computes them all on the CPU
    return {value for value in vars(torch).values() if isinstance(value, torch.dtype)}


def default_backend_for_device(original: Any) -> Any:
    """`get_default_backend_for_device` that names the simulated NCCL group "nccl" (as on a GPU)."""

    def get_default_backend_for_device(device: str | torch.device) -> str:
        from accel.sim.cuda.nccl import process_group as nccl_group

        return nccl_group.to_user(original(device))

    get_default_backend_for_device.__doc__ = original.__doc__
    return get_default_backend_for_device


_installed: list[bool] = []


def install() -> None:
    """Make `torch.accelerator` and torch's own device look-ups answer CUDA in this rank."""
    if _installed:
        return
    torch_internals.patch_accelerator(answers())
    replacement = default_backend_for_device(distributed_c10d.get_default_backend_for_device)
    for module in (dist, distributed_c10d):
        module.get_default_backend_for_device = replacement  # type: ignore[attr-defined]  # patched in simulated ranks
    torch_internals.silence_ddp_time_stats()
    _installed.append(True)
