"""The simulated GPUs of one rank: how many, which is current, and one generator each.

Shared by the tensor subclass, `torch.cuda`'s answers and the checkpoint hooks. A rank
has `LOCAL_WORLD_SIZE` simulated GPUs (as a node with one GPU per process has), and
plain `"cuda"` means the current one, as `torch.cuda.set_device` left it.
"""

from __future__ import annotations

from typing import Any

import torch

#: the seed PyTorch gives every CUDA generator at start-up
DEFAULT_CUDA_SEED = 67280421310721

#: what C++ calls the device under a simulated CUDA tensor (PrivateUse1, renamed)
HIDDEN_DEVICE = "simcuda"


def invalid_ordinal_error() -> RuntimeError:
    """What torch raises on a GPU host for a device index >= device_count()."""
    return RuntimeError(
        "CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported at some other "
        "API call, so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    )


class SimGpus:
    """The simulated GPUs of this rank."""

    def __init__(self, count: int, current: int) -> None:
        self.count = count
        self.current = current
        self.devices = [torch.device("cuda", i) for i in range(count)]
        self.generators = [torch.Generator() for _ in range(count)]
        self.set_device_calls: list[int] = []
        #: whether CUDA has been initialised in this process (`torch.cuda.is_initialized()`):
        #: on a GPU host, by the first use of a GPU (a tensor, set_device, current_device, ...)
        self.initialized = False
        self.reset(current)

    def reset(self, current: int, initialized: bool = True) -> None:
        """Back to start-up: `current` is the current GPU, every generator has torch's default seed.

        `initialized` False: as a new process, which has not used CUDA yet.
        """
        self.current = current
        self.initialized = initialized
        self.set_device_calls.clear()
        for generator in self.generators:
            generator.manual_seed(DEFAULT_CUDA_SEED)

    def resolve(self, device: Any, initialize: bool = True) -> torch.device:
        """`torch.device('cuda', k)` for any way of naming a simulated GPU ('cuda' = the current one).

        Other devices come back unchanged; an index with no GPU raises as on a GPU host.
        Naming a GPU to use it initialises CUDA, as on a GPU host (`initialize`: whether it does).
        """
        if isinstance(device, int) and not isinstance(device, bool):
            index = device
        else:
            device = torch.device(device)
            if device.type not in ("cuda", HIDDEN_DEVICE):
                return device
            index = self.current if device.index is None else device.index
        if not 0 <= index < self.count:
            raise invalid_ordinal_error()
        if initialize:
            self.initialized = True
        return self.devices[index]


_gpus: SimGpus | None = None


def install(count: int, current: int) -> SimGpus:
    """Create this rank's simulated GPUs (again, if they existed)."""
    global _gpus
    _gpus = SimGpus(count, current)
    return _gpus


def uninstall() -> None:
    global _gpus
    _gpus = None


def current() -> SimGpus | None:
    """This rank's simulated GPUs, or None outside a simulated GPU rank."""
    return _gpus


def gpus() -> SimGpus:
    """This rank's simulated GPUs; raises outside a simulated GPU rank."""
    if _gpus is None:
        raise RuntimeError(
            "no simulated GPUs in this process: they exist only in ranks started with device='cuda' "
            "(accel launch --simulate cuda, @distributed_test(device='cuda'), accel.sim.launch(device='cuda'))"
        )
    return _gpus
