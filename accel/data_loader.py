"""Data loading across processes: `prepare_data_loader`, `skip_first_batches` and the classes they build.

A prepared loader gives each process its share of every epoch, with the semantics of
Accelerate's reference pages: sharding by index (`BatchSamplerShard`) or by sample
(`IterableDatasetShard`) when every process can read the data, or loading on the main
process and broadcasting (`DataLoaderDispatcher`). The classes live in `accel.data`;
this module is their public home.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel.data.dispatch import DataLoaderDispatcher
from accel.data.iterable import IterableDatasetShard
from accel.data.loaders import DataLoaderShard, DeviceLoaderWrapper, SkipDataLoader
from accel.data.progress import loader_kwargs
from accel.data.samplers import (
    BatchSamplerShard,
    PermutationSampler,
    SeedableRandomSampler,
    SkipBatchSampler,
    check_process,
)

__all__ = [
    "prepare_data_loader",
    "skip_first_batches",
    "BatchSamplerShard",
    "IterableDatasetShard",
    "DataLoaderShard",
    "DataLoaderDispatcher",
    "SeedableRandomSampler",
    "PermutationSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "DeviceLoaderWrapper",
]


def _partial_state() -> Any:
    from accel.state import PartialState

    return PartialState()


def _agree(value: int, num_processes: int) -> int:
    """`value` as the main process has it, when the loader is prepared for the processes really running."""
    if num_processes == 1:
        return value
    state = _partial_state()
    if state.num_processes != num_processes:  # shards built by hand in one process: nobody to agree with
        return value
    from accel.utils.operations import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def _ordered_batch_sampler(
    batch_sampler: Any, use_seedable_sampler: bool, data_seed: int | None, num_processes: int
) -> tuple[Any, torch.Generator | None, bool]:
    """The batch sampler with a shuffling order every process can reproduce.

    Returns (batch sampler, generator ordering it or None, whether that generator was
    created here with a seed every process agrees on).
    """
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
        return batch_sampler, None, False
    lockstep = False
    if use_seedable_sampler:
        seed = _agree(data_seed if data_seed is not None else torch.initial_seed(), num_processes)
        replacement = SeedableRandomSampler(
            sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples, data_seed=seed
        )
        generator = None
    elif sampler.generator is None:
        # A private generator, seeded alike everywhere, orders the epochs of every process identically.
        generator = torch.Generator()
        drawn = data_seed if data_seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator.manual_seed(_agree(drawn, num_processes))
        replacement = PermutationSampler(
            sampler.data_source, generator, replacement=sampler.replacement, num_samples=sampler._num_samples
        )
        lockstep = True
    else:
        return batch_sampler, sampler.generator, False
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(replacement, batch_sampler.batch_size, batch_sampler.drop_last), generator, lockstep
    batch_sampler.sampler = replacement  # a custom batch sampler: only its sampler can be swapped
    return batch_sampler, generator, lockstep


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    non_blocking: bool = False,
    data_seed: int | None = None,
) -> Any:
    """Wrap `dataloader` so that this process yields only its share of each epoch.

    Args:
        dataloader: the loader to shard (left unchanged; a new one is returned).
        device: where batches go with `put_on_device` (default: this process's device).
        num_processes / process_index: the layout (default: the running processes).
        split_batches: each global batch is one batch of `dataloader`, split across
            processes (its batch size must be a multiple of `num_processes`); otherwise
            each process yields whole batches and a global batch is `num_processes` of them.
        put_on_device: move every batch to `device` (through the backend's device
            loader where it has one, e.g. XLA).
        rng_types: generators to synchronise at the start of each iteration: "torch",
            "cuda", "xla", "generator" (the sampler's, or the iterable dataset's).
        dispatch_batches: load on the main process and broadcast slices (default: True
            for iterable datasets).
        even_batches: complete a short end of the data with samples from the start so
            that every process yields as many batches, all of one size (False: the last
            batches differ). The loader's `drop_last` drops the short end instead.
        slice_fn_for_dispatch: how a process takes its rows of a dispatched batch.
        use_seedable_sampler: shuffle with `SeedableRandomSampler` (order from seed and
            epoch only: reproducible, same on every process).
        non_blocking: asynchronous host-to-device copies.
        data_seed: the seed of the shuffling order (default: drawn once, shared by all processes).
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader() takes a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    if num_processes is None or process_index is None:
        state = _partial_state()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    check_process(num_processes, process_index)
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = iterable
    if put_on_device and device is None:
        device = _partial_state().device
    target = device if put_on_device else None
    kwargs = loader_kwargs(dataloader)
    batch_size = dataloader.batch_size
    if split_batches and batch_size is not None and batch_size % num_processes != 0:
        raise ValueError(
            f"split_batches=True needs a batch size that the number of processes divides: batch_size={batch_size} "
            f"cannot be split across num_processes={num_processes}. Use a batch size that is a multiple of "
            f"{num_processes}, or split_batches=False."
        )

    options = {"device": target, "rng_types": rng_types, "_non_blocking": non_blocking}
    if dispatch_batches:
        prepared = _dispatcher(
            dataloader, kwargs, options, num_processes, process_index, split_batches, even_batches,
            slice_fn_for_dispatch, use_seedable_sampler, data_seed,
        )  # fmt: skip
    elif iterable:
        prepared = _shard_iterable(dataloader, kwargs, options, num_processes, process_index, split_batches)
    else:
        prepared = _shard_map_style(
            dataloader, kwargs, options, num_processes, process_index, split_batches, even_batches,
            use_seedable_sampler, data_seed,
        )  # fmt: skip

    if put_on_device:
        device_loader = _partial_state().hardware.wrap_dataloader(prepared, device)
        if device_loader is not prepared:
            prepared.device = None  # the backend's loader places the batches
            return DeviceLoaderWrapper(prepared, device_loader, device)
    return prepared


def _own_generator(dataset: Any) -> torch.Generator | None:
    generator = getattr(dataset, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _dispatcher(
    dataloader: DataLoader,
    kwargs: dict[str, Any],
    options: dict[str, Any],
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    slice_fn: Callable[..., Any] | None,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> DataLoaderDispatcher:
    state = _partial_state()
    if (num_processes, process_index) != (state.num_processes, state.process_index):
        raise ValueError(
            f"dispatch_batches=True broadcasts between the processes actually running ({state.num_processes}, "
            f"this one {state.process_index}), but num_processes={num_processes} and process_index="
            f"{process_index} were given. Pass dispatch_batches=False to shard locally."
        )
    dataset, batch_size = dataloader.dataset, dataloader.batch_size
    iterable = isinstance(dataset, IterableDataset)
    generator, lockstep = _own_generator(dataset) if iterable else None, False
    if iterable or dataloader.batch_sampler is None:
        kwargs.update(batch_size=batch_size, drop_last=dataloader.drop_last if batch_size is not None else False)
        if not iterable:
            kwargs["sampler"] = dataloader.sampler
    else:
        # Only the main process draws the order, but a generator of its own makes it resumable.
        kwargs["batch_sampler"], generator, lockstep = _ordered_batch_sampler(
            dataloader.batch_sampler, use_seedable_sampler, data_seed, num_processes
        )
    prepared = DataLoaderDispatcher(
        dataset,
        split_batches=split_batches,
        _drop_last=dataloader.drop_last,
        slice_fn=slice_fn,
        synchronized_generator=generator,
        even_batches=even_batches,
        **options,
        **kwargs,
    )
    prepared._generator_in_lockstep = lockstep
    return prepared


def _shard_iterable(
    dataloader: DataLoader,
    kwargs: dict[str, Any],
    options: dict[str, Any],
    num_processes: int,
    process_index: int,
    split_batches: bool,
) -> DataLoaderShard:
    dataset, batch_size = dataloader.dataset, dataloader.batch_size
    generator = _own_generator(dataset)
    if num_processes > 1:
        dataset = IterableDatasetShard(
            dataset,
            batch_size=batch_size if batch_size is not None else 1,
            drop_last=dataloader.drop_last,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
        )
    per_process = batch_size // num_processes if split_batches and batch_size is not None else batch_size
    return DataLoaderShard(
        dataset,
        synchronized_generator=generator,
        _drop_last=dataloader.drop_last,
        batch_size=per_process,
        drop_last=dataloader.drop_last if per_process is not None else False,
        **options,
        **kwargs,
    )


def _shard_map_style(
    dataloader: DataLoader,
    kwargs: dict[str, Any],
    options: dict[str, Any],
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> DataLoaderShard:
    # A BatchSampler given as `sampler` (with batch_size=None) yields the batches itself.
    sampler_is_batch_sampler = dataloader.batch_sampler is None and isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
    if batch_sampler is None:
        if num_processes > 1:
            raise ValueError(
                "prepare_data_loader cannot shard a map-style DataLoader with batch_size=None across "
                f"{num_processes} processes: give it a batch_size or a batch_sampler."
            )
        return DataLoaderShard(dataloader.dataset, batch_size=None, sampler=dataloader.sampler, **options, **kwargs)
    batch_sampler, generator, lockstep = _ordered_batch_sampler(
        batch_sampler, use_seedable_sampler, data_seed, num_processes
    )
    shard = BatchSamplerShard(
        batch_sampler,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        even_batches=even_batches,
    )
    placement = {"sampler": shard, "batch_size": None} if sampler_is_batch_sampler else {"batch_sampler": shard}
    prepared = DataLoaderShard(
        dataloader.dataset,
        synchronized_generator=generator,
        _drop_last=dataloader.drop_last,
        **options,
        **placement,
        **kwargs,
    )
    prepared._generator_in_lockstep = lockstep
    return prepared


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader like `dataloader` that skips its first `num_batches` batches (to resume mid-epoch).

    Works on a plain `DataLoader`, a `DataLoaderShard` and a `DataLoaderDispatcher`
    (and the device wrapper around them); the result is of the same kind. Batches of
    map-style datasets are skipped in the sampler, without loading their data.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    if isinstance(dataloader, DeviceLoaderWrapper):
        inner = skip_first_batches(dataloader.dataloader, num_batches)
        device = dataloader.__dict__["_device"]
        return DeviceLoaderWrapper(inner, _partial_state().hardware.wrap_dataloader(inner, device), device)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches() takes a DataLoader, got {type(dataloader).__name__}")
    dataset = dataloader.dataset
    kwargs = loader_kwargs(dataloader)
    map_style = not isinstance(dataset, IterableDataset)
    if map_style and dataloader.batch_sampler is not None:
        batches = {"batch_sampler": SkipBatchSampler(dataloader.batch_sampler, num_batches)}
        skip = 0
    elif map_style:
        batches = {"batch_size": None, "sampler": SkipBatchSampler(dataloader.sampler, num_batches)}
        skip = 0
    else:
        batches = {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}
        skip = num_batches

    if isinstance(dataloader, DataLoaderDispatcher):
        batches = (
            {"batch_sampler": dataloader.batch_sampler}
            if map_style and dataloader.batch_sampler is not None
            else {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}
        )
        if map_style and dataloader.batch_sampler is None:
            batches["sampler"] = dataloader.sampler
        new: Any = DataLoaderDispatcher(
            dataset,
            split_batches=dataloader.split_batches,
            skip_batches=num_batches,
            _drop_last=dataloader._drop_last,
            _non_blocking=dataloader.non_blocking,
            slice_fn=dataloader.slice_fn,
            device=dataloader.device,
            rng_types=dataloader.rng_types,
            synchronized_generator=dataloader.synchronized_generator,
            even_batches=dataloader.even_batches,
            **batches,
            **kwargs,
        )
    elif isinstance(dataloader, DataLoaderShard):
        new = DataLoaderShard(
            dataset,
            device=dataloader.device,
            rng_types=dataloader.rng_types,
            synchronized_generator=dataloader.synchronized_generator,
            skip_batches=skip,
            _drop_last=dataloader._drop_last,
            _non_blocking=dataloader.non_blocking,
            **batches,
            **kwargs,
        )
        new._generator_in_lockstep = dataloader._generator_in_lockstep
    elif map_style:
        new = DataLoader(dataset, **batches, **kwargs)
    else:
        new = SkipDataLoader(dataset, skip_batches=num_batches, **batches, **kwargs)
    if hasattr(dataloader, "iteration"):
        new.iteration = dataloader.iteration
    return new
