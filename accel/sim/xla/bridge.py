"""What the stand-in `torch_xla` asks of the simulated TPU device.

The stand-in package's modules (`stub/torch_xla/...`) reach the device only through these
functions: which XLA device this process drives, whether a tensor lives there, and the
host tensor a collective carries over Gloo (and back).
"""

from __future__ import annotations

import torch


def xla_device(index: int | None = None) -> torch.device:
    """The XLA device this process drives (one per process, as under PJRT)."""
    return torch.device("cpu")


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on a simulated XLA device."""
    return isinstance(tensor, torch.Tensor)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The host (CPU) tensor holding `tensor`'s data, sharing its storage (for Gloo)."""
    return tensor


def from_host(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A tensor on `device` (default: this process's XLA device) holding the host `tensor`'s data."""
    return tensor
