"""The hidden device under a simulated device's tensors: PrivateUse1, renamed, registered once per process.

C++ must see a device on which autograd runs; a CPU-only build has no CUDA or XLA device
guard, so the wrapper tensors sit on PrivateUse1 (renamed `simcuda`, `simxla`, ...), which
Python can give a guard and hooks. A process hosts one kind of simulated device: the
registration is process-wide and cannot be undone, so a second kind is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.core import torch_internals

_registered: list[str] = []


def register(name: str, module: Any) -> bool:
    """Register the hidden device `name` with its `torch.<name>` module; False if it already was.

    Autograd then runs every node on the thread that called backward() (the hidden device's
    guard reports one device; the results are the same).
    """
    if _registered:
        if _registered[0] != name:
            raise RuntimeError(
                f"this process already hosts the simulated device {_registered[0]!r}: one kind of simulated device "
                f"per process (cannot add {name!r})"
            )
        return False
    torch_internals.register_python_backend(name, module)
    torch.autograd.set_multithreading_enabled(False)
    _registered.append(name)
    return True


def registered() -> str | None:
    """The hidden device of this process, if one is registered."""
    return _registered[0] if _registered else None


class HiddenDeviceModule:
    """`torch.<hidden>`: what torch itself asks the module of the hidden device (one device per process).

    `seed_all` is what `torch.manual_seed` calls for it (None: the device's generator is not
    torch's to seed, as XLA's is not).
    """

    def __init__(self, count: int = 1, seed_all: Any = None) -> None:
        self.count = count
        self._seed_all = seed_all

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        return None

    def manual_seed_all(self, seed: int) -> None:
        if self._seed_all is not None:
            self._seed_all(seed)

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def synchronize(self, device: Any = None) -> None:
        return None
