"""`torch_xla.distributed.parallel_loader` of the simulator: `MpDeviceLoader` and `ParallelLoader`.

As torch_xla's: batches are moved to the device with `xm.send_cpu_data_to_device` (so
tuples come back as lists), the i-th batch of the CPU loader goes to `devices[i %
len(devices)]`, each `next()` of a per-device loader ends the step before (`torch_xla.sync()`,
also the one that raises StopIteration), `len` of a per-device loader is the loader's length
divided by the number of devices, and `MpDeviceLoader` starts a fresh `ParallelLoader` at each
`iter`. Difference: batches are read and moved in the calling thread when asked for
(torch_xla prefetches them in background threads), so the results are the same and the
loader's own collectives (if any) run where the step runs.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch

import torch_xla
import torch_xla.core.xla_model as xm


class PerDeviceLoader:
    """Iterator of one device's batches, on that device."""

    def __init__(self, loader: ParallelLoader, device: torch.device) -> None:
        self._loader = loader
        self._device = device
        self._sync_batch_count = loader.batches_per_execution - 1
        self._batches_yielded = 0

    def __iter__(self) -> PerDeviceLoader:
        return self

    def __next__(self) -> Any:
        return self.next()

    def __len__(self) -> int:
        return self._loader.per_device_samples()

    def next(self) -> Any:
        if self._sync_batch_count <= self._batches_yielded:
            self._batches_yielded = 0
            torch_xla.sync()
        else:
            self._batches_yielded += 1
        item = self._loader.next_item(self._device)
        if item is None:
            torch_xla.sync()
            raise StopIteration
        return item


class ParallelLoader:
    """Feeds `devices` from `cpu_loader`: the i-th batch goes to `devices[i % len(devices)]`."""

    def __init__(
        self,
        cpu_loader: Any,
        devices: list[Any],
        batchdim: int = 0,
        batches_per_execution: int = 1,
        loader_prefetch_size: int = 16,
        device_prefetch_size: int = 8,
        host_to_device_transfer_threads: int = 1,
        input_sharding: Any = None,
    ) -> None:
        if input_sharding is not None:
            raise NotImplementedError(
                "ParallelLoader(input_sharding=...) (accel simulator): SPMD sharding is not simulated"
            )
        self._cpu_loader = cpu_loader
        self._devices = [torch.device(x) for x in devices]
        self._batchdim = batchdim
        self._batches_per_execution = batches_per_execution
        self._queues: dict[torch.device, collections.deque[Any]] = {d: collections.deque() for d in self._devices}
        self._iterator: Iterator[Any] | None = None
        self._exhausted = False
        self._done = False

    def per_device_loader(self, device: Any) -> PerDeviceLoader:
        """The iterator of `device`'s batches."""
        return PerDeviceLoader(self, torch.device(device))

    def per_device_samples(self) -> int:
        return len(self._cpu_loader) // len(self._devices)

    @property
    def batches_per_execution(self) -> int:
        return self._batches_per_execution

    def _read_round(self) -> None:
        # One batch per device; torch_xla's loader drops a last round that does not fill every device.
        if self._iterator is None:
            self._iterator = iter(self._cpu_loader)
        batches = []
        for _ in self._devices:
            try:
                batches.append(next(self._iterator))
            except StopIteration:
                self._exhausted = True
                return
        for device, batch in zip(self._devices, batches, strict=True):
            with torch.no_grad():
                self._queues[device].append(self.send_cpu_data_to_device([batch], device)[0])

    def next_item(self, device: torch.device) -> Any:
        """`device`'s next batch, or None when the loader is exhausted (or closed)."""
        queue = self._queues[device]
        while not queue and not self._exhausted and not self._done:
            self._read_round()
        return queue.popleft() if queue else None

    def send_cpu_data_to_device(self, batches: list[Any], device: torch.device) -> Any:
        return xm.send_cpu_data_to_device(batches, device)

    def close(self) -> None:
        self._done = True
        for queue in self._queues.values():
            queue.clear()


class MpDeviceLoader:
    """Wrap `loader` so that iterating it yields batches on `device` (multi-process data parallelism)."""

    def __init__(self, loader: Any, device: Any, **kwargs: Any) -> None:
        self._loader = loader
        self._device = device
        self._parallel_loader_kwargs = kwargs
        self._parallel_loader: ParallelLoader | None = None

    def __iter__(self) -> PerDeviceLoader:
        if self._parallel_loader is not None:
            self._parallel_loader.close()
            self._parallel_loader = None
        self._parallel_loader = ParallelLoader(self._loader, [self._device], **self._parallel_loader_kwargs)
        return self._parallel_loader.per_device_loader(self._device)

    def __len__(self) -> int:
        return len(self._loader)
