"""Data loading across processes: `prepare_data_loader`, `skip_first_batches` and the classes they build.

A prepared loader gives each process its share of every epoch, with the semantics of
Accelerate's reference pages: sharding by index (`BatchSamplerShard`) or by sample
(`IterableDatasetShard`) when every process can read the data, or loading on the main
process and broadcasting (`DataLoaderDispatcher`). The classes live in `accel.data`;
this module is their public home.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel.data.dispatch import DataLoaderDispatcher
from accel.data.iterable import IterableDatasetShard
from accel.data.loaders import DataLoaderShard, DeviceLoaderWrapper, SkipDataLoader
from accel.data.progress import DataLoaderStateMixin, check_device_mesh, get_sampler, loader_kwargs
from accel.data.samplers import (
    BatchSamplerShard,
    PermutationSampler,
    SeedableRandomSampler,
    SkipBatchSampler,
    check_process,
)

__all__ = [
    "prepare_data_loader",
    "DataLoaderStateMixin",
    "get_sampler",
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
    replacement: RandomSampler
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


@dataclasses.dataclass
class LoaderOptions:
    """How a prepared loader is built: the settings every builder shares.

    `prepare_data_loader` makes one; each prepared loader keeps it (`_options`), so that
    `skip_first_batches` rebuilds the loader through the same constructor path.
    """

    num_processes: int = 1
    process_index: int = 0
    #: where batches go (None: left where the loader puts them)
    device: Any = None
    rng_types: Any = None
    non_blocking: bool = False
    split_batches: bool = False
    even_batches: bool = True
    slice_fn: Callable[..., Any] | None = None
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    use_stateful_dataloader: bool = False
    #: the original loader's drop_last
    drop_last: bool = False


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
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
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
        dispatch_batches: load on the main process and broadcast slices (default, as in
            Accelerate: True for iterable datasets when `put_on_device`, else False).
        even_batches: complete a short end of the data with samples from the start so
            that every process yields as many batches, all of one size (False: the last
            batches differ). The loader's `drop_last` drops the short end instead.
            One process is left as it is.
        slice_fn_for_dispatch: how a process takes its rows of a dispatched batch.
        use_seedable_sampler: shuffle with `SeedableRandomSampler` (order from seed and
            epoch only: reproducible, same on every process).
        data_seed: the seed of the shuffling order (default: drawn once, shared by all processes).
        non_blocking: asynchronous host-to-device copies.
        use_stateful_dataloader: load through torchdata's `StatefulDataLoader` (its state
            is then part of the loader's `state_dict`).
        torch_device_mesh: accepted for compatibility; only None (plain data parallelism).
    """
    _refuse_unshardable(dataloader, torch_device_mesh)
    options = LoaderOptions(
        **_placement(num_processes, process_index, device, put_on_device),
        rng_types=rng_types,
        non_blocking=non_blocking,
        split_batches=split_batches,
        even_batches=even_batches,
        slice_fn=slice_fn_for_dispatch,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        use_stateful_dataloader=use_stateful_dataloader,
        drop_last=dataloader.drop_last,
    )
    return _build_prepared(dataloader, options, dispatch_batches, put_on_device)


def _refuse_unshardable(dataloader: Any, torch_device_mesh: Any) -> None:
    """Fail early on what `prepare_data_loader` cannot shard: not a DataLoader, or a device mesh."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader() takes a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    check_device_mesh(torch_device_mesh)


def _placement(
    num_processes: int | None, process_index: int | None, device: torch.device | None, put_on_device: bool
) -> dict[str, Any]:
    """The checked process layout (default: the running processes) and where batches go, as `LoaderOptions` fields."""
    if num_processes is None or process_index is None:
        state = _partial_state()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    check_process(num_processes, process_index)
    if put_on_device and device is None:
        device = _partial_state().device
    return {"num_processes": num_processes, "process_index": process_index, "device": device if put_on_device else None}


def _check_split_batches(batch_size: int | None, options: LoaderOptions) -> None:
    """With `split_batches`, every process needs an equal slice of each batch."""
    num_processes = options.num_processes
    if options.split_batches and batch_size is not None and batch_size % num_processes != 0:
        raise ValueError(
            "split_batches=True needs a batch size that is a round multiple of the number of processes: "
            f"batch_size={batch_size} cannot be split across num_processes={num_processes}. Use a batch size that "
            f"is a multiple of {num_processes}, or split_batches=False."
        )


def _build_prepared(
    dataloader: DataLoader, options: LoaderOptions, dispatch_batches: bool | None, put_on_device: bool
) -> Any:
    """This process's loader: batches dispatched from the main process, or its shard of the dataset or sampler."""
    _check_split_batches(dataloader.batch_size, options)
    iterable = isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches is None:  # as Accelerate: iterable datasets put on a device are dispatched
        dispatch_batches = iterable and put_on_device
    prepared: Any
    if dispatch_batches:
        prepared = _dispatcher(dataloader, options)
    elif iterable:
        prepared = _shard_iterable(dataloader, options)
    else:
        prepared = _shard_map_style(dataloader, options)

    if put_on_device:
        return _on_device(prepared, options.device)
    return prepared


def _on_device(prepared: Any, device: Any) -> Any:
    """`prepared`, fed through the backend's device loader where the hardware has one (XLA)."""
    device_loader = _partial_state().hardware.wrap_dataloader(prepared, device)
    if device_loader is prepared:
        return prepared
    prepared.device = None  # the backend's loader places the batches
    return DeviceLoaderWrapper(prepared, device_loader, device)


def _build(
    cls: type,
    dataset: Any,
    options: LoaderOptions,
    batches: dict[str, Any],
    kwargs: dict[str, Any],
    generator: torch.Generator | None = None,
    lockstep: bool = False,
    skip_batches: int = 0,
    iteration: int = 0,
) -> Any:
    """The one constructor path of prepared loaders (`DataLoaderShard` or `DataLoaderDispatcher`).

    `batches` says how batches are formed (batch_sampler, or sampler / batch_size /
    drop_last), `kwargs` are the worker and collation arguments of the original loader.
    """
    common = dict(
        device=options.device,
        rng_types=options.rng_types,
        synchronized_generator=generator,
        skip_batches=skip_batches,
        use_stateful_dataloader=options.use_stateful_dataloader,
        iteration=iteration,
        _drop_last=options.drop_last,
        _non_blocking=options.non_blocking,
    )
    if cls is DataLoaderDispatcher:
        common.update(split_batches=options.split_batches, even_batches=options.even_batches, slice_fn=options.slice_fn)
    prepared = cls(dataset, **common, **batches, **kwargs)
    prepared._options = options
    prepared._generator_in_lockstep = lockstep
    return prepared


def _options_of(loader: Any) -> LoaderOptions:
    """The options `loader` was built with, as it stands now (also for a loader built by hand)."""
    options = getattr(loader, "_options", None)
    if options is None:
        options = LoaderOptions(
            rng_types=loader.rng_types,
            split_batches=getattr(loader, "split_batches", False),
            even_batches=getattr(loader, "even_batches", True),
            slice_fn=getattr(loader, "slice_fn", None),
        )
    # Where the backend's device loader places the batches, the loader itself has no device.
    return dataclasses.replace(
        options,
        device=loader.device,
        non_blocking=loader.non_blocking,
        drop_last=loader._drop_last,
        use_stateful_dataloader=loader.use_stateful_dataloader,
    )


def _own_generator(dataset: Any) -> torch.Generator | None:
    generator = getattr(dataset, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _dispatcher(dataloader: DataLoader, options: LoaderOptions) -> DataLoaderDispatcher:
    state = _partial_state()
    num_processes, process_index = options.num_processes, options.process_index
    if (num_processes, process_index) != (state.num_processes, state.process_index):
        raise ValueError(
            f"dispatch_batches=True broadcasts between the processes actually running ({state.num_processes}, "
            f"this one {state.process_index}), but num_processes={num_processes} and process_index="
            f"{process_index} were given. Pass dispatch_batches=False to shard locally."
        )
    dataset, batch_size = dataloader.dataset, dataloader.batch_size
    iterable = isinstance(dataset, IterableDataset)
    generator, lockstep = _own_generator(dataset) if iterable else None, False
    batches: dict[str, Any]
    if iterable or dataloader.batch_sampler is None:
        batches = {"batch_size": batch_size, "drop_last": dataloader.drop_last if batch_size is not None else False}
        if not iterable:
            batches["sampler"] = dataloader.sampler
    else:
        # Only the main process draws the order, but a generator of its own makes it resumable.
        batch_sampler, generator, lockstep = _ordered_batch_sampler(
            dataloader.batch_sampler, options.use_seedable_sampler, options.data_seed, num_processes
        )
        batches = {"batch_sampler": batch_sampler}
    return _build(DataLoaderDispatcher, dataset, options, batches, loader_kwargs(dataloader), generator, lockstep)


def _shard_iterable(dataloader: DataLoader, options: LoaderOptions) -> DataLoaderShard:
    dataset, batch_size = dataloader.dataset, dataloader.batch_size
    num_processes = options.num_processes
    generator = _own_generator(dataset)
    if num_processes > 1:
        dataset = IterableDatasetShard(
            dataset,
            batch_size=batch_size if batch_size is not None else 1,
            drop_last=dataloader.drop_last,
            num_processes=num_processes,
            process_index=options.process_index,
            split_batches=options.split_batches,
        )
    per_process = batch_size // num_processes if options.split_batches and batch_size is not None else batch_size
    batches = {"batch_size": per_process, "drop_last": dataloader.drop_last if per_process is not None else False}
    return _build(DataLoaderShard, dataset, options, batches, loader_kwargs(dataloader), generator)


def _shard_map_style(dataloader: DataLoader, options: LoaderOptions) -> DataLoaderShard:
    num_processes = options.num_processes
    kwargs = loader_kwargs(dataloader)
    # A BatchSampler given as `sampler` (with batch_size=None) yields the batches itself.
    sampler_is_batch_sampler = dataloader.batch_sampler is None and isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
    if batch_sampler is None:
        if num_processes > 1:
            raise ValueError(
                "prepare_data_loader cannot shard a map-style DataLoader with batch_size=None across "
                f"{num_processes} processes: give it a batch_size or a batch_sampler."
            )
        batches = {"batch_size": None, "sampler": dataloader.sampler}
        return _build(DataLoaderShard, dataloader.dataset, options, batches, kwargs)
    batch_sampler, generator, lockstep = _ordered_batch_sampler(
        batch_sampler, options.use_seedable_sampler, options.data_seed, num_processes
    )
    shard = BatchSamplerShard(
        batch_sampler,
        num_processes=num_processes,
        process_index=options.process_index,
        split_batches=options.split_batches,
        # As in Accelerate, one process is left as it is (its loader is not sharded at all there).
        even_batches=options.even_batches and num_processes > 1,
    )
    batches = {"sampler": shard, "batch_size": None} if sampler_is_batch_sampler else {"batch_sampler": shard}
    return _build(DataLoaderShard, dataloader.dataset, options, batches, kwargs, generator, lockstep)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader like `dataloader` that skips its first `num_batches` batches (to resume mid-epoch).

    Works on a plain `DataLoader`, a `DataLoaderShard` and a `DataLoaderDispatcher`
    (and the device wrapper around them); the result is of the same kind, rebuilt
    through the constructor path of `prepare_data_loader`. Batches of map-style
    datasets are skipped in the sampler, without loading their data.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    if isinstance(dataloader, DeviceLoaderWrapper):
        inner = skip_first_batches(dataloader.dataloader, num_batches)
        device = dataloader.__dict__["_device"]
        return DeviceLoaderWrapper(inner, _partial_state().hardware.wrap_dataloader(inner, device), device)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"skip_first_batches() takes a DataLoader, got {type(dataloader).__name__}")
    # Resuming by hand, Accelerate's way (load_state, then skip_first_batches for the rest of that
    # epoch): the position load_state restored must not shorten the loader's next pass as well.
    if getattr(dataloader, "_resume", None) is not None:
        dataloader._resume = None
    dataset = dataloader.dataset
    kwargs = loader_kwargs(dataloader)
    map_style = not isinstance(dataset, IterableDataset)
    if isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
        dispatcher = isinstance(dataloader, DataLoaderDispatcher)
        batches: dict[str, Any]
        if map_style and dataloader.batch_sampler is not None:
            # The dispatcher skips whole global batches itself; a shard skips in its sampler.
            sampler = dataloader.batch_sampler
            batches = {"batch_sampler": sampler if dispatcher else SkipBatchSampler(sampler, num_batches)}
        elif map_style:
            sampler = dataloader.sampler if dispatcher else SkipBatchSampler(dataloader.sampler, num_batches)
            batches = {"batch_size": dataloader.batch_size, "sampler": sampler}
        else:
            batches = {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last}
        skip = num_batches if dispatcher or not map_style else 0
        return _build(
            DataLoaderDispatcher if dispatcher else DataLoaderShard,
            dataset,
            _options_of(dataloader),
            batches,
            kwargs,
            dataloader.synchronized_generator,
            dataloader._generator_in_lockstep,
            skip_batches=skip,
            iteration=dataloader.iteration,
        )
    if map_style and dataloader.batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches), **kwargs)
    if map_style:
        return DataLoader(dataset, batch_size=None, sampler=SkipBatchSampler(dataloader.sampler, num_batches), **kwargs)
    return SkipDataLoader(
        dataset, skip_batches=num_batches, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **kwargs
    )
