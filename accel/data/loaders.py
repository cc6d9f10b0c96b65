"""`DataLoaderShard` (each process loads its own shard) and small loader wrappers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from accel.data.iterable import IterableDatasetShard
from accel.data.progress import _END, DataLoaderStateMixin, LoaderProgress, check_device_mesh


class DataLoaderShard(LoaderProgress, DataLoader):
    """A `DataLoader` for one process's shard, with device placement and epoch bookkeeping.

    Built by `prepare_data_loader` around a `BatchSamplerShard` (map-style datasets) or
    an `IterableDatasetShard`. On top of a plain `DataLoader` it

    - synchronises the `rng_types` generators across processes at the start of each
      iteration (so shuffling agrees everywhere);
    - moves each batch to `device` (when given) before fetching the next one;
    - looks one batch ahead, to tell `GradientState` when the last batch is in use
      (`end_of_dataloader`) and how much of the last global batch is padding
      (`remainder`);
    - skips its first `skip_batches` batches (from the sampler when it can, without
      loading their data), and resumes mid-epoch through `state_dict` /
      `load_state_dict`.

    Args:
        dataset: the dataset (already sharded for iterable datasets).
        device: where to put every batch (None: leave them where they are).
        rng_types: generators to synchronise at each iteration ("torch", "cuda",
            "xla", "generator").
        synchronized_generator: the generator meant by "generator".
        skip_batches: batches to skip at the start of every iteration.
        **kwargs: the arguments of `torch.utils.data.DataLoader`.
    """

    def __init__(
        self,
        dataset: Any,
        device: Any = None,
        rng_types: Any = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> None:
        check_device_mesh(torch_device_mesh)
        super().__init__(dataset, **kwargs)
        self._drop_last = _drop_last
        self._init_progress(device, rng_types, synchronized_generator, skip_batches, _non_blocking)
        self.iteration = iteration

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)

    @property
    def _may_be_uneven(self) -> bool:
        """Whether processes may end with batches of different sizes or counts (even_batches=False)."""
        base = self._base_batch_sampler()
        return not getattr(base, "even_batches", True) and getattr(base, "num_processes", 1) > 1

    def _last_padding(self) -> int:
        """Samples added to the last global batch of this pass (-1 if it cannot be known here)."""
        base = self._base_batch_sampler()
        if hasattr(base, "padding"):
            return base.padding  # the batch sampler runs in this process, even with workers
        if isinstance(self.dataset, IterableDatasetShard):
            # With workers the shard runs in their processes: fall back on the dataset's length.
            return self.dataset.padding if self.num_workers == 0 else self.dataset.expected_padding()
        return 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator of batches, not torch's iterator class
        start = self._start_epoch()
        position = self._position
        iterator = self._base_iterator(start)
        place = self._placer()
        self.begin()
        try:
            try:
                current = next(iterator)
            except StopIteration:
                self._complete_epoch()
                return
            stateful = self.use_stateful_dataloader
            while True:
                if place is not None:
                    current = place(current)
                if stateful:
                    self._snapshot()  # before reading ahead: the state after `current`
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    break
                position[0] += 1
                yield current
                current = upcoming
            self.remainder = self._last_padding()
            self.end_of_dataloader = True
            position[0] += 1
            yield current
            self._complete_epoch()
        finally:
            self.end()


class SkipDataLoader(DataLoaderStateMixin, DataLoader):
    """A plain `DataLoader` that drops its first `skip_batches` batches at every iteration.

    Used for iterable datasets, where batches cannot be skipped without reading them.
    While iterated it is the loader `GradientState` follows (`end_of_dataloader` on its
    last batch). `use_stateful_dataloader=True` loads through torchdata's
    `StatefulDataLoader` (and its `state_dict`).
    """

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        #: the StatefulDataLoader state after the last batch handed out (stateful loaders only)
        self.dl_state_dict: dict[str, Any] | None = None
        self._handed_out = 0  # batches of the current pass, skipped ones included
        self._in_pass = False
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator of batches, not torch's iterator class
        stateful = self.use_stateful_dataloader
        resume, self._resume = self._resume, None
        self.begin()
        try:
            iterator: Iterator[Any] = super().__iter__()
            if stateful and resume is not None:
                self._handed_out = int(resume.get("_num_yielded", 0))  # the StatefulDataLoader resumes itself
            else:
                self._handed_out = max(int((resume or {}).get("batches_yielded", 0)), self.skip_batches)
                iterator = itertools.islice(iterator, self._handed_out, None)
            self._in_pass = True
            current = next(iterator, _END)
            while current is not _END:
                if stateful:
                    self._snapshot()
                upcoming = next(iterator, _END)
                self.end_of_dataloader = upcoming is _END
                self._handed_out += 1
                yield current
                current = upcoming
            self._in_pass = False
        finally:
            self.end()

    def _snapshot(self) -> None:
        self.dl_state_dict = super().state_dict()  # type: ignore[misc]  # StatefulDataLoader's, later in the MRO
        self.adjust_state_dict_for_prefetch()

    def adjust_state_dict_for_prefetch(self) -> None:
        """Hook to correct `self.dl_state_dict` just taken; nothing to do: it is taken before reading ahead."""

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands: the StatefulDataLoader's state, or the batches handed out."""
        if self.use_stateful_dataloader:
            if self._in_pass and self.dl_state_dict is not None:
                return self.dl_state_dict
            return super().state_dict()  # type: ignore[misc]  # StatefulDataLoader's, later in the MRO
        return {"batches_yielded": self._handed_out if self._in_pass else 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next pass continue after the batches `state_dict` says were handed out."""
        if self.use_stateful_dataloader:
            super().load_state_dict(state_dict)  # type: ignore[misc]  # StatefulDataLoader's, later in the MRO
        elif "batches_yielded" not in state_dict:
            raise ValueError(f"not a SkipDataLoader state (no 'batches_yielded'): keys {sorted(state_dict)}")
        self._resume = dict(state_dict)

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


class DeviceLoaderWrapper:
    """A prepared loader fed through the backend's device loader (XLA's `MpDeviceLoader`).

    Iterating goes through the backend's loader; everything else (`set_epoch`,
    `total_batch_size`, `state_dict`, `len`, ...) is the prepared loader's.
    """

    def __init__(self, loader: Any, device_loader: Any, device: Any = None) -> None:
        self._loader = loader
        self._device_loader = device_loader
        self._device = device

    @property
    def dataloader(self) -> Any:
        """The prepared loader inside."""
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self._device_loader)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("_loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)
