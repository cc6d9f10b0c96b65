"""The simulated GPUs of one rank: how many, which is current, and one generator each.

Shared by the tensor subclass, `torch.cuda`'s answers and the checkpoint hooks. A rank
has `LOCAL_WORLD_SIZE` simulated GPUs (as a node with one GPU per process has), and
plain `"cuda"` means the current one, as `torch.cuda.set_device` left it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from accel.sim.cuda.gpus.generators import GpuGenerator

#: the seed PyTorch gives every CUDA generator at start-up
DEFAULT_CUDA_SEED = 67280421310721

#: what C++ calls the device under a simulated CUDA tensor (PrivateUse1, renamed)
HIDDEN_DEVICE = "simcuda"


def invalid_ordinal_error() -> RuntimeError:
    """What torch raises on a GPU host for a device index >= device_count() (CUDA errors are
    `torch.AcceleratorError`, a RuntimeError, as a real H200 showed)."""
    return torch.AcceleratorError(
        "CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported at some other "
        "API call, so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    )


#: what each process reads when CUDA starts: which of the host's GPUs it sees, in which order
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def uuid_of(physical: int) -> str:
    """The UUID a simulated host's GPU `physical` reports (stable: the same GPU, the same UUID)."""
    return f"GPU-5e1a7ed0-acce-1000-8000-{physical:012x}"


def parse_visible(value: str | None, physical: int) -> list[int]:
    """The host GPUs `CUDA_VISIBLE_DEVICES=value` makes visible, as CUDA reads it.

    Unset: all of them. Entries are ordinals or (prefixes of) UUIDs; the list ends at the
    first entry that names no GPU of the host, and a list naming one GPU twice shows none.
    """
    if value is None:
        return list(range(physical))
    seen: list[int] = []
    uuids = [uuid_of(i) for i in range(physical)]
    for entry in value.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            if len(matches) != 1:
                break
            index = matches[0]
        else:
            digits = len(entry) - len(entry.lstrip("0123456789"))
            if not digits:
                break
            index = int(entry[:digits])
            if index >= physical:
                break
        if index in seen:
            return []
        seen.append(index)
    return seen


def _generators(count: int) -> list[torch.Generator]:
    """One generator per GPU the process sees, each saying it is that GPU's (`torch.cuda.default_generators`)."""
    return [GpuGenerator(torch.device("cuda", index)) for index in range(count)]


class SimGpus:
    """The simulated GPUs of this rank: the host has `physical` of them, the process sees `visible`."""

    def __init__(self, physical: int, current: int) -> None:
        self.physical = physical
        self.visible: list[int] = list(range(physical))
        #: the current GPU of the main thread, and of threads that set none; a thread that sets one has its own
        #: (`current`), as CUDA keeps one per host thread (DataParallel's replicas run in threads of their own)
        self._shared = current
        self._threads = threading.local()
        self._generation = 0  # `reset` forgets the threads' own by moving on
        self.devices = [torch.device("cuda", i) for i in range(physical)]
        self.generators = _generators(physical)
        self.set_device_calls: list[int] = []
        #: the current stream of each GPU that `torch.cuda.stream` / `set_stream` set (else the default stream)
        self.streams: dict[int, Any] = {}
        #: whether CUDA has been initialised in this process (`torch.cuda.is_initialized()`):
        #: on a GPU host, by the first use of a GPU (a tensor, set_device, current_device, ...)
        self.initialized = False
        #: whether the visible GPUs are fixed: CUDA reads CUDA_VISIBLE_DEVICES when it starts
        #: (each test or script starts with none used yet, so it may still set it)
        self.started = False
        #: called with this object when the visible GPUs are fixed (the memory counters follow them)
        self.on_start: list[Any] = []
        self.reset(current)

    @property
    def current(self) -> int:
        """The calling thread's current GPU (`torch.cuda.current_device()`)."""
        own = getattr(self._threads, "current", None)
        return own[1] if own is not None and own[0] == self._generation else self._shared

    @current.setter
    def current(self, index: int) -> None:
        if threading.current_thread() is threading.main_thread():
            self._shared = index
            self._threads.current = None
        else:
            self._threads.current = (self._generation, index)

    @property
    def count(self) -> int:
        """How many GPUs this process sees (`torch.cuda.device_count()`)."""
        if not self.started:
            self._see(parse_visible(os.environ.get(VISIBLE_ENV), self.physical))
        return len(self.visible)

    def _see(self, visible: list[int]) -> None:
        if visible == self.visible:
            return
        self.visible = visible
        self.devices = [torch.device("cuda", i) for i in range(len(visible))]
        self.generators = _generators(len(visible))
        for generator in self.generators:
            generator.manual_seed(DEFAULT_CUDA_SEED)

    def start(self) -> None:
        """CUDA starts: the visible GPUs are read from the environment and fixed."""
        if self.started:
            return
        self._see(parse_visible(os.environ.get(VISIBLE_ENV), self.physical))
        if self.current >= len(self.visible):
            self.current = 0  # a process starts on the first GPU it sees
        self.started = True
        if not self.visible:
            self.started = False  # nothing to start: CUDA fails, and may try again later
            raise RuntimeError("No CUDA GPUs are available")
        for callback in self.on_start:
            callback(self)

    @property
    def initialized(self) -> bool:
        """Whether CUDA has been initialised in this process (`torch.cuda.is_initialized()`)."""
        return self._initialized

    @initialized.setter
    def initialized(self, value: bool) -> None:
        self._initialized = value
        # torch's own flag, read as it is: activation checkpointing stashes the GPU's RNG state for its
        # recomputation only where it is set (else dropout draws other masks when recomputed)
        torch.cuda._initialized = value

    def use(self) -> None:
        """A GPU is used: CUDA starts (if it had not) and counts as initialised."""
        if not self.started:
            self.start()
        self.initialized = True

    def physical_of(self, index: int) -> int:
        """The host GPU behind visible GPU `index` (what NCCL tells GPUs apart by)."""
        return self.visible[index]

    def reset(self, current: int, initialized: bool = True) -> None:
        """Back to start-up: `current` is the current GPU, every generator has torch's default seed.

        `initialized` False: as a new process, which has not used CUDA yet. Either way the
        visible GPUs are read again when a GPU is next used.
        """
        self.started = False
        self._generation += 1
        self._shared = current
        self.initialized = initialized
        self.set_device_calls.clear()
        self.streams.clear()
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
            index = -1 if device.index is None else device.index
        if initialize:
            self.use()
        if index < 0:
            index = self.current
        if not 0 <= index < self.count:
            raise invalid_ordinal_error()
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
