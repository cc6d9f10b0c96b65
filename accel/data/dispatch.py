"""`DataLoaderDispatcher`: the main process loads, every process gets its slice by broadcast.

For each global batch the main process broadcasts a small header (the nesting, shapes
and dtypes of the batch, how many rows are real, how many are padding) and then the
tensors themselves, one collective per dtype. Every process then keeps its rows.
Values of a batch that are not tensors travel in the header, whole, to every process.
Errors on the main process (a failing dataset, a batch without tensors) are broadcast
in the header too, so every process raises instead of waiting forever.
"""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from accel.data.progress import _END, LoaderProgress, _is_stateful, _stateful_base, check_device_mesh
from accel.utils.operations import TensorInformation, concatenate, find_batch_size, recursively_apply, slice_tensors

_EMPTY = object()  # this process's share of a global batch has no rows


def describe_batch(batch: Any, where: str = "batch") -> Any:
    """The batch's nesting with each tensor replaced by its shape and dtype.

    Other values (strings, numbers, `None`...) stay as they are: they travel in the header,
    so every process receives the main process's values whole, as Accelerate passes them
    along (they are not split between processes). They must be picklable.
    """
    if isinstance(batch, torch.Tensor):
        return TensorInformation(tuple(batch.shape), batch.dtype)
    if isinstance(batch, (list, tuple)):
        items = [describe_batch(item, f"{where}[{i}]") for i, item in enumerate(batch)]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, Mapping):
        return {key: describe_batch(value, f"{where}[{key!r}]") for key, value in batch.items()}
    return batch


def _allocate(structure: Any, device: torch.device) -> Any:
    return recursively_apply(
        lambda info: torch.empty(info.shape, dtype=info.dtype, device=device),
        structure,
        test_type=lambda obj: isinstance(obj, TensorInformation),
    )


def _clone(batch: Any) -> Any:
    return recursively_apply(torch.clone, batch)


class DataLoaderDispatcher(LoaderProgress, DataLoader):
    """A `DataLoader` iterated on the main process only; each process receives its slice of every batch.

    The default for iterable datasets when batches are put on the device (whose
    samples may not be reproducible on every process). A global batch is
    `num_processes` batches of the wrapped loader (or one, with `split_batches=True`);
    each process gets `1 / num_processes` of its rows. A short last global batch is
    completed with rows from the first batch (`even_batches=True`; `remainder` says how
    many), dropped (the loader's `drop_last`), or split as it is (`even_batches=False`:
    the last slices differ, and a process whose slice is empty stops one batch earlier).
    Batches of varying sizes (a batch sampler without `batch_size`) are split in slices
    whose sizes differ by one row at most, none lost; with `even_batches=True` a last
    batch of fewer rows than processes is completed to one row each.

    Args:
        dataset, **kwargs: as for `torch.utils.data.DataLoader` (per-process batch size).
        split_batches: each global batch is one batch of the wrapped loader.
        skip_batches: global batches to skip at the start of every iteration.
        use_stateful_dataloader: the main process loads through torchdata's `StatefulDataLoader`;
            `state_dict` then holds its state as of the last global batch handed out (taken
            before the main process reads the next one), from which a loaded pass resumes.
        slice_fn: `slice_fn(batch, slice, process_index=, num_processes=)` taking a
            process's rows (default `slice_tensors`).
        device: where to put the slices (default: the communication device).
        rng_types / synchronized_generator: generators to synchronise at each iteration.
        even_batches: see above.
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Callable[..., Any] | None = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        *,
        device: Any = None,
        rng_types: Any = None,
        synchronized_generator: torch.Generator | None = None,
        even_batches: bool = True,
        **kwargs: Any,
    ) -> None:
        from accel.state import PartialState

        check_device_mesh(torch_device_mesh)
        super().__init__(dataset, **kwargs)
        state = PartialState()
        self.state = state
        self.num_processes, self.process_index = state.num_processes, state.process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.slice_fn = slice_fn if slice_fn is not None else slice_tensors
        self._drop_last = bool(_drop_last or self.drop_last or getattr(self.batch_sampler, "drop_last", False))
        size = self.batch_size if self.batch_size is not None else getattr(self.batch_sampler, "batch_size", None)
        if split_batches and (size is None or size % self.num_processes != 0):
            raise ValueError(
                "split_batches=True needs a batch size that is a round multiple of the number of processes: "
                f"batch_size={size} "
                f"cannot be split across num_processes={self.num_processes}. Use a batch size that is a multiple "
                f"of {self.num_processes}, or split_batches=False."
            )
        self._base_batch_size = size
        self._init_progress(device, rng_types, synchronized_generator, skip_batches, _non_blocking)
        self.iteration = iteration
        self._first: Any = None
        self._pending: Any = _END  # main process: the prepared next global batch (_END: not fetched yet)
        self._snapshot_of_current: Any = None  # main process: the stateful loader's state after the current batch

    # -- sizes -----------------------------------------------------------------------------

    def _global_factor(self) -> int:
        return 1 if self.split_batches else self.num_processes

    @property
    def total_batch_size(self) -> int | None:
        size = self._base_batch_size
        return size * self._global_factor() if size is not None else None

    @property
    def _may_be_uneven(self) -> bool:
        return not self.even_batches and self.num_processes > 1

    def __len__(self) -> int:
        base = super().__len__()
        n = self._global_factor()
        count = base // n if self._drop_last else -(-base // n)
        return max(count - self.skip_batches, 0)

    # -- main process: global batches ------------------------------------------------------------

    def _global_batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        per_global = self._global_factor()
        while True:
            parts = list(itertools.islice(iterator, per_global))
            if not parts:
                return
            yield parts[0] if len(parts) == 1 else concatenate(parts)

    def _even_out(self, batch: Any) -> tuple[Any, int, int] | None:
        """(batch, real rows, padding rows) after completing or dropping a short batch; None: dropped."""
        rows = find_batch_size(batch)
        size = self.total_batch_size
        if size is None:
            # Batches of varying sizes: each is split as evenly as rows allow. Only a (last)
            # batch too small to give every process a row needs completing (even_batches).
            if rows >= self.num_processes or not self.even_batches:
                return batch, rows, 0
            size = self.num_processes
        if rows == size or self.num_processes == 1:
            return batch, rows, 0
        if rows > size:
            if self.even_batches:
                raise ValueError(
                    f"even_batches=True needs global batches of {size} rows, got one of {rows}. Pass "
                    "even_batches=False for batches of varying sizes."
                )
            return batch, rows, 0
        if self._drop_last:
            return None
        if not self.even_batches:
            return batch, rows, 0
        need = size - rows
        source = self._first if self._first is not None else _clone(batch)
        available = find_batch_size(source)
        pieces = [batch] + [source] * (need // available)
        if need % available:
            pieces.append(slice_tensors(source, slice(0, need % available)))
        return concatenate(pieces), rows, need

    def _prepare_next(self, source: Iterator[Any]) -> tuple[Any, Any, int, int, Any] | None:
        """(global batch, its description, real rows, padding rows, the loader's state once it is read), or None
        when there is none left."""
        batch = next(source, _END)
        if batch is _END:
            return None
        # A stateful loader's state right after this global batch, before the main process reads the next one:
        # the state to resume from once this batch is handed out.
        snapshot = _stateful_base(self).state_dict(self) if _is_stateful(self) else None
        described = describe_batch(batch)
        evened = self._even_out(batch)
        if evened is None:  # a short last batch, dropped
            return None
        if self._first is None:
            self._first = _clone(batch)
        batch, rows, padding = evened
        return batch, describe_batch(batch) if padding else described, rows, padding, snapshot

    def _next_header(self, source: Iterator[Any]) -> tuple[list[Any], Any]:
        """Main process: the header of the next global batch, and the batch (or the error met)."""
        try:
            if self._pending is _END:
                self._pending = self._prepare_next(source)
            current = self._pending
            if current is None:
                return [("end",)], None
            # One global batch ahead, so that the header can say which batch is the last.
            self._pending = self._prepare_next(source)
            batch, described, rows, padding, self._snapshot_of_current = current
            return [("batch", described, rows, padding, self._pending is None)], batch
        except Exception as error:  # every process must learn of it, or they would wait forever
            return [("error", type(error).__name__, str(error))], error

    # -- every process ---------------------------------------------------------------------------

    def _exchange(self, source: Iterator[Any] | None) -> Any:
        """One global batch, as (this process's share or _EMPTY, padding, is last, the stateful loader's state
        after it: main process only); None if there is none."""
        from accel.utils.operations import broadcast, broadcast_object_list, send_to_device

        comm_device = self.state.device
        payload = None
        self._snapshot_of_current = None
        if source is not None:
            header, payload = self._next_header(source)
        else:
            header = [None]
        broadcast_object_list(header, from_process=0)
        kind = header[0][0]
        if kind == "end":
            return None
        if kind == "error":
            if isinstance(payload, BaseException):
                raise payload
            _, name, message = header[0]
            # The main process's error, of the same type where it is a built-in one (TypeError for a
            # batch that cannot be broadcast, as in Accelerate), so that every rank can catch it alike.
            kind_of_error = getattr(builtins, name, None)
            if not (isinstance(kind_of_error, type) and issubclass(kind_of_error, Exception)):
                kind_of_error = RuntimeError
            raise kind_of_error(f"DataLoaderDispatcher: the main process failed to produce a batch: {name}: {message}")
        _, structure, rows, padding, last = header[0]
        n, r = self.num_processes, self.process_index
        if rows < n and not last:
            raise ValueError(
                f"DataLoaderDispatcher cannot give each of {n} processes a part of a global batch of {rows} rows; "
                "only the last batch may be smaller than the number of processes."
            )
        batch = send_to_device(payload, comm_device) if source is not None else _allocate(structure, comm_device)
        batch = broadcast(batch, from_process=0)
        if padding or rows == self.total_batch_size:
            share = rows + padding
            lo, hi = r * share // n, (r + 1) * share // n
        else:
            # An uneven batch: contiguous slices whose sizes differ by one at most.
            base, extra = divmod(rows, n)
            lo = r * base + min(r, extra)
            hi = lo + base + (1 if r < extra else 0)
        snapshot = self._snapshot_of_current
        if hi <= lo:
            return _EMPTY, padding, last, snapshot
        mine = self.slice_fn(batch, slice(lo, hi), process_index=r, num_processes=n)
        if self.device is not None:
            mine = send_to_device(mine, self.device, non_blocking=self.non_blocking)
        return mine, padding, last, snapshot

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator of batches, not torch's iterator class
        start = self._start_epoch()
        position = self._position
        source = None
        self._first, self._pending = None, _END
        if self.process_index == 0:
            source = self._global_batches(self._base_iterator(start * self._global_factor()))
        self.begin()
        try:
            step = self._exchange(source)
            # Every process makes the same exchanges: one per global batch, one batch ahead.
            while step is not None:
                share, padding, last, snapshot = step
                upcoming = None if last else self._exchange(source)
                if upcoming is not None and upcoming[0] is _EMPTY:
                    # Nothing for this process in the (last) next batch: this one is its last.
                    padding, last, upcoming = upcoming[1], True, None
                if share is _EMPTY:
                    break
                if last:
                    self.remainder = padding
                    self.end_of_dataloader = True
                position[0] += 1
                if snapshot is not None:
                    # the main process's loader state as of this batch (it read one global batch further)
                    self.dl_state_dict = snapshot
                    self.adjust_state_dict_for_prefetch()
                yield share
                step = upcoming
            self._complete_epoch()
        finally:
            self._first, self._pending = None, _END
            self.end()
