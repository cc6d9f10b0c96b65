"""What every prepared loader shares: epoch bookkeeping, RNG sync, GradientState wiring, resume.

`LoaderProgress` is mixed into `DataLoaderShard` and `DataLoaderDispatcher`. It keeps
the per-batch path free of work: everything here runs once per epoch, except one
counter increment per batch (the resume position).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from accel.data.iterable import IterableDatasetShard
from accel.data.samplers import BatchSamplerShard, SkipBatchSampler
from accel.state import GradientState
from accel.utils.dataclasses import RNGType

#: constructor arguments of `DataLoader` that a rebuilt loader takes over unchanged
LOADER_ARGUMENTS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The worker / collation arguments of `loader`, to build an equivalent one."""
    return {name: getattr(loader, name) for name in LOADER_ARGUMENTS if hasattr(loader, name)}


def unwrap_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler under any `SkipBatchSampler` wrappers."""
    while isinstance(batch_sampler, SkipBatchSampler):
        batch_sampler = batch_sampler.__dict__["batch_sampler"]
    return batch_sampler


def normalize_rng_types(rng_types: Any, generator: torch.Generator | None) -> list[RNGType]:
    """`rng_types` as `RNGType`s; "generator" is dropped when there is no generator to synchronise."""
    if not rng_types:
        return []
    if isinstance(rng_types, (str, RNGType)):
        rng_types = [rng_types]
    types = [RNGType(t) for t in rng_types]
    return [t for t in types if t != RNGType.GENERATOR or generator is not None]


def check_device_mesh(torch_device_mesh: Any) -> None:
    """Refuse a device mesh: accel shards data over plain data parallelism only."""
    if torch_device_mesh is not None:
        raise NotImplementedError(
            "torch_device_mesh is for tensor / context parallelism, which accel does not support: every process "
            "is a data-parallel rank here. Pass torch_device_mesh=None."
        )


def stateful_dataloader_class() -> type:
    """torchdata's `StatefulDataLoader`, or an ImportError that says what to install."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ImportError(
            "use_stateful_dataloader=True needs torchdata's StatefulDataLoader (torchdata >= 0.8), which is not "
            "installed: `pip install torchdata`, or leave use_stateful_dataloader=False (accel's loaders resume "
            "mid-epoch without it)."
        ) from error
    return StatefulDataLoader


def stateful_variant(cls: type) -> type:
    """`cls` loading through torchdata's `StatefulDataLoader` instead of `DataLoader` (made once per class)."""
    name = f"Stateful{cls.__name__}"
    module = __import__(cls.__module__, fromlist=["_"])
    variant = module.__dict__.get(name)
    if variant is None:
        variant = type(name, (cls, stateful_dataloader_class()), {"__module__": cls.__module__})
        variant.__qualname__ = name
        setattr(module, name, variant)  # picklable by name, like the class it extends
    return variant


class DataLoaderStateMixin:
    """What `GradientState` reads from the loader being iterated (Accelerate's name for it).

    - `end_of_dataloader`: True while the last batch of the pass is in use;
    - `remainder`: how many samples of the last global batch are padding added to even
      it out (-1 while unknown).

    `begin()` and `end()` register the loader with `GradientState` around a pass.
    """

    end_of_dataloader: bool = False
    remainder: int = -1

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        # The loader classes take `use_stateful_dataloader=`: the instance is then of the
        # class's Stateful... variant, and __init__ runs as usual.
        if use_stateful_dataloader and not issubclass(cls, stateful_dataloader_class()):
            cls = stateful_variant(cls)
        return super().__new__(cls)

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether this loader loads through torchdata's `StatefulDataLoader`."""
        return _is_stateful(self)

    def reset(self) -> None:
        """Forget the end of the previous pass."""
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        """Start a pass: reset, and become the loader `GradientState` follows."""
        self.reset()
        GradientState()._add_dataloader(self)

    def end(self) -> None:
        """End a pass: `GradientState` stops following this loader."""
        # GradientState is imported at module level: this runs in generator finalisers,
        # possibly while the interpreter shuts down and can no longer import.
        GradientState()._remove_dataloader(self)

    @property
    def gradient_state(self) -> GradientState:
        """The shared `GradientState` this loader reports to."""
        return GradientState()

    @property
    def base_dataloader(self) -> Any:
        """A plain torch loader over the same dataset and batches, as Accelerate's wrappers hold.

        It yields this rank's batches as its batch sampler gives them (a `SkipDataLoader`'s
        base skips none; nothing is moved to a device or reported to `GradientState`),
        through `StatefulDataLoader` when this loader is stateful. Made once; a loader that
        is not a `DataLoader` is its own base.
        """
        if not isinstance(self, DataLoader):
            return self
        base = self.__dict__.get("_base_dataloader")
        if base is None:
            base = _plain_copy(self)
            self.__dict__["_base_dataloader"] = base
        return base


def _plain_copy(loader: DataLoader) -> DataLoader:
    """A `DataLoader` (or `StatefulDataLoader`) with `loader`'s dataset, batching and workers."""
    cls = stateful_dataloader_class() if _is_stateful(loader) else DataLoader
    batch_sampler = loader.batch_sampler
    if isinstance(loader.dataset, IterableDataset) or batch_sampler is None:
        # torch refuses a batch sampler with an iterable dataset: give the batch size instead
        batching: dict[str, Any] = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    else:
        batching = {"batch_sampler": batch_sampler}
    workers: dict[str, Any] = {}
    if loader.num_workers > 0:
        workers = {
            "num_workers": loader.num_workers,
            "worker_init_fn": loader.worker_init_fn,
            "prefetch_factor": loader.prefetch_factor,
            "persistent_workers": loader.persistent_workers,
            "multiprocessing_context": loader.multiprocessing_context,
        }
    return cls(
        loader.dataset,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        generator=loader.generator,
        **batching,
        **workers,
    )


def get_sampler(dataloader: Any) -> Any:
    """The sampler that orders `dataloader`'s indices (the one inside its batch sampler)."""
    holder = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler
    return getattr(holder, "sampler", None)


class LoaderProgress(DataLoaderStateMixin):
    """Mixin for `DataLoader` subclasses: epochs, RNG sync, GradientState, `state_dict`.

    Attributes read by `GradientState` while the loader is being iterated:
    `end_of_dataloader` (True while the last batch is in use) and `remainder` (how
    many samples of the last global batch are padding added to even it out; -1 while
    unknown).

    Built with `use_stateful_dataloader=True`, a loader is its class's `Stateful...`
    variant, loading through torchdata's `StatefulDataLoader`: its `state_dict` then
    also holds that loader's own state (taken after the last batch handed out), and a
    resumed pass continues from it instead of skipping batches.
    """

    # What the DataLoader this is mixed into provides (for type checkers; no values here).
    dataset: Any
    sampler: Any
    batch_sampler: Any
    batch_size: int | None
    num_workers: int
    persistent_workers: bool
    #: the StatefulDataLoader state after the last batch handed out (stateful loaders only)
    dl_state_dict: dict[str, Any] | None

    def get_sampler(self) -> Any:
        """The sampler that orders the indices (see `get_sampler`)."""
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        """Replace the sampler inside the batch sampler (and inside a sharded batch sampler's source)."""
        holder = unwrap_batch_sampler(self._base_batch_sampler())
        if isinstance(holder, BatchSamplerShard):
            holder = unwrap_batch_sampler(holder.batch_sampler)
        holder.sampler = sampler

    def adjust_state_dict_for_prefetch(self) -> None:
        """Hook to correct the `StatefulDataLoader` state just taken (`self.dl_state_dict`); nothing by default.

        accel takes that state after the batch it hands out and before it reads ahead,
        so it needs no correction; subclasses whose loading runs further ahead can.
        """

    def _snapshot(self) -> None:
        """Record the `StatefulDataLoader` state as of the batches handed out so far (stateful loaders only)."""
        if _is_stateful(self):
            self.dl_state_dict = _stateful_base(self).state_dict(self)
            self.adjust_state_dict_for_prefetch()

    def _init_progress(
        self,
        device: Any,
        rng_types: Any,
        synchronized_generator: torch.Generator | None,
        skip_batches: int,
        non_blocking: bool,
    ) -> None:
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.device = device
        self.synchronized_generator = synchronized_generator
        self.rng_types = normalize_rng_types(rng_types, synchronized_generator)
        self.skip_batches = skip_batches
        self.non_blocking = non_blocking
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1
        #: set when every process seeded `synchronized_generator` alike and nothing else draws
        #: from it: its states then stay equal without a broadcast at each epoch.
        self._generator_in_lockstep = False
        self._position = [0]  # batches of this epoch consumed; a list so the batch loop skips DataLoader.__setattr__
        self._in_epoch = False
        self._epoch_state: dict[str, Any] = {}
        self._resume: dict[str, Any] | None = None
        self._skip_now = 0
        self.dl_state_dict = None

    @property
    def _batches_yielded(self) -> int:
        return self._position[0]

    @_batches_yielded.setter
    def _batches_yielded(self, value: int) -> None:
        self._position[0] = value

    # -- what the epoch's order depends on ---------------------------------------------

    def _base_batch_sampler(self) -> Any:
        sampler = self.batch_sampler if self.batch_sampler is not None else self.sampler
        return unwrap_batch_sampler(sampler)

    def _order_sampler(self) -> Any:
        """The sampler that orders the indices (None for iterable datasets)."""
        if isinstance(self.dataset, IterableDataset):
            return None
        base = self._base_batch_sampler()
        if isinstance(base, BatchSamplerShard):
            base = unwrap_batch_sampler(base.batch_sampler)
        return getattr(base, "sampler", base)

    def _order_generator(self) -> torch.Generator | None:
        if self.synchronized_generator is not None:
            return self.synchronized_generator
        source = self.dataset
        if isinstance(source, IterableDatasetShard):
            source = source.dataset
        elif not isinstance(source, IterableDataset):
            source = self._order_sampler()
        generator = getattr(source, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch here and on the sampler and dataset that take one (`DistributedSampler`-style)."""
        self.iteration = epoch
        base = self._base_batch_sampler()
        if hasattr(base, "set_epoch"):
            base.set_epoch(epoch)
        else:
            sampler = self._order_sampler()
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    # -- sizes ---------------------------------------------------------------------------

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (None for batches of varying sizes)."""
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset.global_batch_size
        base = self._base_batch_sampler()
        if isinstance(base, BatchSamplerShard):
            if base.batch_size is None or base.split_batches:
                return base.batch_size
            return base.batch_size * base.num_processes
        size = self.batch_size if self.batch_size is not None else getattr(base, "batch_size", None)
        return size * self._global_factor() if size is not None else None

    def _global_factor(self) -> int:
        return 1

    @property
    def _may_be_uneven(self) -> bool:
        """Whether processes may end with batches of different sizes or counts (even_batches=False)."""
        return False

    @property
    def total_dataset_length(self) -> int:
        """Length of the whole dataset (every process's samples together)."""
        return getattr(self.dataset, "total_length", None) or len(self.dataset)

    # -- epoch start and end -------------------------------------------------------------

    def _start_epoch(self) -> int:
        """Synchronise the RNGs, apply a pending resume; return how many batches to skip."""
        types = self.rng_types
        if types and self._generator_in_lockstep:
            types = [t for t in types if t != RNGType.GENERATOR]
        if types:
            from accel.utils.random import synchronize_rng_states

            synchronize_rng_states(types, generator=self.synchronized_generator)
        # As Accelerate: every pass tells the samplers and dataset its epoch (DistributedSampler-style
        # samplers and datasets that reshuffle per epoch need no set_epoch call in the training loop).
        self.set_epoch(self.iteration)
        resume, self._resume = self._resume, None
        generator, sampler = self._order_generator(), self._order_sampler()
        position = 0
        if resume is not None:
            if resume.get("generator_state") is not None and generator is not None:
                generator.set_state(resume["generator_state"])
            if resume.get("sampler_epoch") is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(resume["sampler_epoch"])
            position = int(resume.get("batches_yielded", 0))
        self._epoch_state = self._order_state(generator, sampler)
        self._batches_yielded = max(position, self.skip_batches)
        self._in_epoch = True
        self.__dict__.pop("_owed_gathers", None)  # left over from an epoch that was broken off
        if resume is not None and resume.get("stateful_dataloader") is not None and _is_stateful(self):
            return 0  # the StatefulDataLoader resumes where its state was taken
        return self._batches_yielded

    @staticmethod
    def _order_state(generator: torch.Generator | None, sampler: Any) -> dict[str, Any]:
        return {
            "generator_state": generator.get_state() if generator is not None else None,
            "sampler_epoch": getattr(sampler, "epoch", None),
        }

    def _complete_epoch(self) -> None:
        if self._may_be_uneven:
            from accel.utils.metrics import settle_uneven_end

            settle_uneven_end(self)
        self.iteration += 1
        self._batches_yielded = 0
        self._in_epoch = False

    # -- resume ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: enough for `load_state_dict` to resume on the next batch.

        Holds the epoch counter, the batches of the current epoch already yielded, and
        what the epoch's order depends on (the state of the order's generator at the
        start of the epoch, the sampler's epoch).
        """
        if self._in_epoch:
            order = self._epoch_state
        else:
            order = self._order_state(self._order_generator(), self._order_sampler())
        state = {
            "iteration": self.iteration,
            "batches_yielded": self._batches_yielded if self._in_epoch else 0,
            **order,
        }
        if _is_stateful(self):
            # Between passes there is nothing to resume: the next pass starts afresh.
            state["stateful_dataloader"] = self.dl_state_dict if self._in_epoch else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iteration resume where `state_dict` was taken (same epoch, next batch)."""
        if "batches_yielded" not in state_dict:
            raise ValueError(f"not a data loader state (no 'batches_yielded'): keys {sorted(state_dict)}")
        self.iteration = state_dict.get("iteration", self.iteration)
        self._resume = dict(state_dict)
        inner = state_dict.get("stateful_dataloader")
        if inner is not None:
            if not _is_stateful(self):
                raise ValueError(
                    "this data loader state was saved by a loader built with use_stateful_dataloader=True; load it "
                    "into one built the same way (DataLoaderConfiguration(use_stateful_dataloader=True))"
                )
            _stateful_base(self).load_state_dict(self, inner)

    # -- skipping at the index level -------------------------------------------------------

    def _can_skip_indices(self) -> bool:
        """Whether skipped batches can be dropped from the sampler, without loading their data."""
        persistent = self.persistent_workers and self.num_workers > 0
        return not isinstance(self.dataset, IterableDataset) and self.batch_sampler is not None and not persistent

    @property
    def _index_sampler(self) -> Any:
        sampler = DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]  # a property in torch
        skip = self.__dict__.get("_skip_now", 0)
        return SkipBatchSampler(sampler, skip) if skip else sampler

    def _base_iterator(self, skip_batches: int) -> Any:
        """A fresh iterator of the underlying DataLoader, `skip_batches` batches in."""
        by_index = skip_batches if self._can_skip_indices() else 0
        self._skip_now = by_index
        # DataLoader.__iter__ draws its base seed from the global torch RNG. Started mid-epoch,
        # the run being continued drew it already (its RNG state was restored from the
        # checkpoint), so a second draw would shift dropout & co. away from the uninterrupted run.
        rng_state = torch.get_rng_state() if skip_batches else None
        try:
            # The next loader class in line: DataLoader, or torchdata's StatefulDataLoader.
            iterator = super().__iter__()  # type: ignore[misc]  # mixin: the DataLoader comes later in the MRO
        finally:
            self._skip_now = 0
            if rng_state is not None:
                torch.set_rng_state(rng_state)
        for _ in range(skip_batches - by_index):
            if next(iterator, _END) is _END:
                break
        return iterator

    def _placer(self) -> Any:
        """The function that moves a batch to `device` (None when there is nothing to move)."""
        if self.device is None:
            return None
        from accel.utils.operations import send_to_device

        device, non_blocking = torch.device(self.device), self.non_blocking
        tensor = torch.Tensor

        if device.type == "cpu":

            def keep_on_cpu(batch: Any) -> Any:
                # Batches are on the CPU already, mostly: the usual flat ones (a list, tuple or dict
                # of plain tensors, as default_collate makes them) are handed on after a look at
                # their devices; anything else goes through send_to_device's generic walk.
                kind = type(batch)
                leaves = batch if kind is list or kind is tuple else batch.values() if kind is dict else (batch,)
                for leaf in leaves:
                    if type(leaf) is not tensor or leaf.device != device:
                        return send_to_device(batch, device, non_blocking=non_blocking)
                return batch

            return keep_on_cpu

        # Keyword arguments cost a tensor method call more than the check around it: pass
        # non_blocking only when it is asked for.
        if non_blocking:

            def move(leaf: torch.Tensor) -> torch.Tensor:
                return leaf.to(device, non_blocking=True)
        else:

            def move(leaf: torch.Tensor) -> torch.Tensor:
                return leaf.to(device)

        def place(batch: Any) -> Any:
            # Batches come from host memory, mostly, and do move. The usual flat ones (a list,
            # tuple or dict of plain tensors) are moved leaf by leaf without reading their
            # devices (a costly property on simulated GPUs): .to() returns a tensor already on
            # `device` as it is, which is send_to_device's rule too (a plain tensor's device that
            # prints like `device` is `device`). Anything else goes through send_to_device.
            kind = type(batch)
            if kind is tensor:
                return move(batch)
            leaves = batch if kind is list or kind is tuple else batch.values() if kind is dict else None
            if leaves is None:
                return send_to_device(batch, device, non_blocking=non_blocking)
            for leaf in leaves:
                if type(leaf) is not tensor:
                    return send_to_device(batch, device, non_blocking=non_blocking)
            placed = [move(leaf) for leaf in leaves]
            if all(map(operator.is_, placed, leaves)):
                return batch  # nothing moved: no new container
            if kind is dict:
                return dict(zip(batch, placed, strict=True))
            return placed if kind is list else tuple(placed)

        return place


def _is_stateful(loader: Any) -> bool:
    return _stateful_base(loader) is not None


def _stateful_base(loader: Any) -> Any:
    """torchdata's `StatefulDataLoader` class when `loader` is built on it (None otherwise)."""
    for cls in type(loader).__mro__:
        if cls.__name__ == "StatefulDataLoader" and cls.__module__.startswith("torchdata"):
            return cls
    return None


_END = object()
