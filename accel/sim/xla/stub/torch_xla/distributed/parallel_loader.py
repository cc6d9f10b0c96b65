"""`MpDeviceLoader` / `ParallelLoader` of the simulator: batches moved to the XLA device.

The XLA device is the CPU here, so moving is cheap; what matters is the shape of the
API (`MpDeviceLoader(loader, device)`, iteration, `len`, the wrapped `_loader`) and the
`mark_step` after each batch that the real loader issues.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import torch_xla.core.xla_model as xm


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return type(data)({key: _to_device(value, device) for key, value in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_to_device(value, device) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(value, device) for value in data)
    return data


class PerDeviceLoader:
    """Iterates the wrapped loader, yielding batches on `device`."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self._loader = loader
        self._device = device
        self._iterator: Iterator[Any] | None = None
        self._batches = 0

    def __iter__(self) -> PerDeviceLoader:
        self._iterator = iter(self._loader)
        self._batches = 0
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            iter(self)
        if self._batches:
            # Like the real loader: the step of the previous batch is cut when the next is asked for.
            xm.mark_step()
        assert self._iterator is not None  # set by iter(self) above
        batch = next(self._iterator)
        self._batches += 1
        return _to_device(batch, self._device)

    next = __next__

    def __len__(self) -> int:
        return len(self._loader)


class ParallelLoader:
    """Feeds each listed device from `loader` (one device per process in the simulator)."""

    def __init__(self, loader: Any, devices: list[Any], **kwargs: Any) -> None:
        self._loader = loader
        self._devices = [torch.device(device) for device in devices]

    def per_device_loader(self, device: Any) -> PerDeviceLoader:
        return PerDeviceLoader(self._loader, torch.device(device))

    def per_device_samples(self) -> int:
        return len(self._loader)


class MpDeviceLoader:
    """Wrap `loader` so that iterating it yields batches on `device`."""

    def __init__(self, loader: Any, device: Any, **kwargs: Any) -> None:
        self._loader = loader
        self._device = torch.device(device)
        self._parallel_loader_kwargs = kwargs

    def __iter__(self) -> PerDeviceLoader:
        return iter(
            ParallelLoader(self._loader, [self._device], **self._parallel_loader_kwargs).per_device_loader(self._device)
        )

    def __len__(self) -> int:
        return len(self._loader)
