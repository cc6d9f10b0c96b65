"""Fake CUDA: the real `CUDABackend` on CPU tensors, and `torch.cuda` answering as on a GPU host.

Installed only inside a simulated rank (see `accel.sim.devices.prepare_rank`). Two parts:

* `SimCUDABackend` subclasses the real `CUDABackend` and swaps only its hardware touch
  points: the device under the tensors is the CPU, collectives go over Gloo instead of
  NCCL, `set_device` is recorded instead of called, autocast and the GradScaler use the
  CPU implementations (both accept fp16 and bf16 in torch >= 2.4). Everything else — DDP
  wrapping and `join`, the RNG calls, the distributed type (`MULTI_GPU`) — is the real
  backend's code.
* `install()` patches the `torch.cuda` functions a training script asks (`is_available`,
  `device_count`, `current_device`, `set_device`, the RNG and seeding functions, memory
  statistics, ...) so that the script takes its GPU branches. Each simulated GPU has its
  own CPU `torch.Generator` standing in for its CUDA generator. Random tensors created on
  `accelerator.device` (the CPU) draw from the CPU generator, not from the simulated
  CUDA one: that is the one place where the streams differ from a real GPU run.

What cannot be simulated — a tensor on a real `cuda` device (`torch.zeros(..., device="cuda")`,
`tensor.cuda()`, `module.cuda()`, `.to("cuda")`, streams) — raises `SimulatedDeviceError`
telling the user to put tensors on `accelerator.device` instead. We raise rather than
silently redirect `.cuda()` to the CPU: a redirect would give tensors whose `.device`
says "cpu" where the code expects "cuda", which hides the mismatch instead of naming it.
torch calls `torch.cuda._lazy_init` before touching any CUDA tensor, so patching that one
function catches every such use.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.cuda
import torch.cuda.random

from accel.backends.cuda import CUDABackend

#: the seed PyTorch gives every CUDA generator at start-up
DEFAULT_CUDA_SEED = 67280421310721

_HINT = (
    "this process runs on the accel simulator's fake CUDA, whose devices are CPU tensors: "
    "create tensors on `accelerator.device` (or `PartialState().device`) and move models with "
    "`.to(accelerator.device)` / `accelerator.prepare(...)` instead of naming 'cuda'"
)


class SimulatedDeviceError(RuntimeError):
    """Something a real GPU can do but the simulator cannot (a tensor on a real `cuda` device)."""


class _FakeCuda:
    """The simulated GPUs of this rank: how many, which one is current, their generators."""

    def __init__(self, device_count: int, current: int) -> None:
        self.device_count = device_count
        self.generators = [torch.Generator() for _ in range(device_count)]
        self.set_device_calls: list[int] = []
        self.reset(current)

    def reset(self, current: int) -> None:
        self.current = current
        self.set_device_calls.clear()
        for generator in self.generators:
            generator.manual_seed(DEFAULT_CUDA_SEED)

    def index(self, device: Any = None) -> int:
        """Index of the simulated GPU named by `device` (None/'cuda': the current one)."""
        if device is None:
            return self.current
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"expected a cuda device, got {device}")
            index = self.current if device.index is None else device.index
        if not 0 <= index < self.device_count:
            raise SimulatedDeviceError(
                f"CUDA device {index} does not exist: this simulated rank has {self.device_count} "
                f"GPU(s) (LOCAL_WORLD_SIZE), numbered 0..{self.device_count - 1}"
            )
        return index


_fake: _FakeCuda | None = None
_originals: dict[tuple[Any, str], Any] = {}


def is_installed() -> bool:
    """Whether the fake CUDA is active in this process."""
    return _fake is not None


def _get() -> _FakeCuda:
    if _fake is None:
        raise RuntimeError("fake CUDA is not installed in this process (accel.sim.fake_cuda.install)")
    return _fake


def set_device_calls() -> list[int]:
    """Indices passed to `torch.cuda.set_device` in this rank since the last reset (tests read it)."""
    return list(_get().set_device_calls)


# -- the simulated torch.cuda functions --------------------------------------------------


def _unsupported(what: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise SimulatedDeviceError(f"{what} is not available: {_HINT}")

    fail.__name__ = what.rsplit(".", 1)[-1].strip("()")
    return fail


def _set_device(device: Any) -> None:
    fake = _get()
    index = fake.index(device)
    fake.current = index
    fake.set_device_calls.append(index)


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    fake = _get()
    return fake.generators[fake.index(device)].get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    fake = _get()
    fake.generators[fake.index(device)].set_state(new_state.clone())


def _get_rng_state_all() -> list[torch.Tensor]:
    return [generator.get_state() for generator in _get().generators]


def _set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        _set_rng_state(state, index)


def _manual_seed(seed: int) -> None:
    fake = _get()
    fake.generators[fake.current].manual_seed(int(seed))


def _manual_seed_all(seed: int) -> None:
    for generator in _get().generators:
        generator.manual_seed(int(seed))


def _seed() -> None:
    fake = _get()
    fake.generators[fake.current].seed()


def _seed_all() -> None:
    # Like torch: one fresh random seed shared by every device.
    _manual_seed_all(random.getrandbits(63))


def _initial_seed() -> int:
    fake = _get()
    return fake.generators[fake.current].initial_seed()


class _device(contextlib.ContextDecorator):
    """`torch.cuda.device(i)`: make simulated GPU `i` current inside the block."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None or device == -1 else _get().index(device)
        self.previous = -1

    def __enter__(self) -> _device:
        fake = _get()
        self.previous = fake.current
        if self.index >= 0:
            fake.current = self.index
        return self

    def __exit__(self, *exc: Any) -> None:
        _get().current = self.previous


def _patches() -> dict[str, Any]:
    zero = lambda device=None: 0  # noqa: E731  (memory counters: nothing is allocated on a fake GPU)
    none = lambda *args, **kwargs: None  # noqa: E731
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": none,
        "_lazy_init": _unsupported("a tensor on a real CUDA device"),
        "device_count": lambda: _get().device_count,
        "current_device": lambda: _get().current,
        "set_device": _set_device,
        "device": _device,
        "get_device_name": lambda device=None: f"Simulated CUDA device {_get().index(device)} (accel.sim, on CPU)",
        "get_device_capability": lambda device=None: (8, 0),
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": lambda device=None: None,
        "empty_cache": none,
        "ipc_collect": none,
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "reset_peak_memory_stats": none,
        "reset_max_memory_allocated": none,
        "mem_get_info": _unsupported("torch.cuda.mem_get_info()"),
        "get_device_properties": _unsupported("torch.cuda.get_device_properties()"),
        "current_stream": _unsupported("torch.cuda.current_stream()"),
        "default_stream": _unsupported("torch.cuda.default_stream()"),
        "stream": _unsupported("torch.cuda.stream()"),
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "get_rng_state_all": _get_rng_state_all,
        "set_rng_state_all": _set_rng_state_all,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed_all,
        "seed": _seed,
        "seed_all": _seed_all,
        "initial_seed": _initial_seed,
    }


_RNG_NAMES = (
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
)  # fmt: skip


def install(local_rank: int | None = None, device_count: int | None = None) -> None:
    """Patch `torch.cuda` in this process to answer for `device_count` simulated GPUs.

    Defaults come from the launcher's environment: `LOCAL_WORLD_SIZE` GPUs, the current
    one being `LOCAL_RANK` (as `set_device(local_rank)` would make it). Idempotent.
    """
    global _fake
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if device_count is None:
        device_count = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if _fake is not None:
        uninstall()
    _fake = _FakeCuda(max(device_count, 1), local_rank % max(device_count, 1))
    for name, replacement in _patches().items():
        # The RNG functions live in torch.cuda.random and are re-exported by torch.cuda.
        modules = (torch.cuda, torch.cuda.random) if name in _RNG_NAMES else (torch.cuda,)
        for module in modules:
            _originals.setdefault((module, name), getattr(module, name, None))
            setattr(module, name, replacement)


def uninstall() -> None:
    """Restore the real `torch.cuda` functions."""
    global _fake
    for (module, name), original in _originals.items():
        if original is None:
            delattr(module, name)
        else:
            setattr(module, name, original)
    _originals.clear()
    _fake = None


def reset(local_rank: int | None = None) -> None:
    """Between tests: current device back to `local_rank`, generators reseeded to torch's default."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    fake = _get()
    fake.reset(local_rank % fake.device_count)


@contextlib.contextmanager
def installed(local_rank: int = 0, device_count: int = 1) -> Iterator[None]:
    """Fake CUDA for the duration of a block (single-process tests)."""
    install(local_rank, device_count)
    try:
        yield
    finally:
        uninstall()


class SimCUDABackend(CUDABackend):
    """The real CUDA backend with its hardware touch points moved to the CPU and Gloo."""

    name = "sim_cuda"
    comm_backend = "gloo"
    autocast_device_type = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._index: int | None = None

    @classmethod
    def is_available(cls) -> bool:
        return is_installed()

    def _cuda_device(self, index: int) -> torch.device:
        # Tensors live on the CPU; remember which simulated GPU this rank was given.
        self._index = index
        return torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif self._index is not None:
            torch.cuda.set_device(self._index)
