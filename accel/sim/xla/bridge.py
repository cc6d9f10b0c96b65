"""What the stand-in `torch_xla` asks of the simulated TPU device.

The stand-in package's modules (`stub/torch_xla/...`) reach the device only through these
functions: which XLA device this process drives, whether a tensor lives there, the host
tensor a collective carries over Gloo (and back), and the device's RNG seed. The device
itself is `accel.sim.xla.device` (XLA tensors on the core's wrapper tensor); it is
installed in every simulated TPU rank, and here on first use otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.xla import device as _device


def _ensure() -> None:
    if not _device.is_installed():
        _device.install()


def xla_device(index: int | None = None) -> torch.device:
    """The XLA device this process drives: `xla:0`, as under PJRT (one device per process, whatever its ordinal).

    `index` (as `xm.xla_device(n)`) names a device of this process: only 0 exists here.
    """
    _ensure()
    return _device.SIM.resolve(torch.device("xla", index) if index is not None else "xla")


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on a simulated XLA device."""
    return _device.is_xla_tensor(tensor)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The host (CPU) tensor holding `tensor`'s data, sharing its storage (for Gloo); a host tensor unchanged."""
    return _device.to_host(tensor)


def from_host(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A tensor on `device` (default: this process's XLA device) holding the host `tensor`'s data (shared).

    A `device` that is not an XLA one (the CPU) gives `tensor` back unchanged.
    """
    _ensure()
    if device is not None and not _device.SIM.is_mine(device):
        return tensor
    return _device.from_host(tensor, device)


def set_rng_state(seed: int, device: Any = None) -> None:
    """`xm.set_rng_state(seed)`: the device's RNG seed (what its next random op draws from)."""
    _ensure()
    _device.SIM.set_seed(seed)


def get_rng_state(device: Any = None) -> int:
    """`xm.get_rng_state()`: the device's running seed (XLA's: it moves on after each random op)."""
    _ensure()
    return _device.SIM.running_seed


def reset() -> None:
    """Between tests in a warm rank: the device's seed back to XLA's default, autocast off."""
    if _device.is_installed():
        _device.reset()
