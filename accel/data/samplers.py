"""Index samplers for sharded data loading.

- `SeedableRandomSampler`: a random order that depends only on (seed, epoch), so every
  process draws the same permutation without exchanging anything.
- `BatchSamplerShard`: the batches of one process out of a batch sampler that every
  process iterates identically.
- `SkipBatchSampler`: a batch sampler minus its first batches, used to resume mid-epoch
  without loading the data of the batches already seen.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler


def cycle_to_length(source: Sequence[Any], length: int) -> list[Any]:
    """The first `length` items of `source` repeated end to end (used to pad a last batch)."""
    if length <= 0:
        return []
    if not source:
        raise ValueError("cannot pad a batch from an empty source")
    repeats = -(-length // len(source))
    return (list(source) * repeats)[:length]


def check_process(num_processes: int, process_index: int) -> None:
    """Reject a process layout that cannot exist, naming the values."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if not isinstance(process_index, int) or not 0 <= process_index < num_processes:
        raise ValueError(f"process_index must be in [0, {num_processes}), got {process_index!r}")


class SeedableRandomSampler(RandomSampler):
    """A `RandomSampler` whose order is a function of `initial_seed + epoch` only.

    Every process that builds it with the same seed draws the same permutation for a
    given epoch, which is what sharding by index needs. The epoch advances by one after
    each complete pass, or is set explicitly with `set_epoch` (the prepared loader
    forwards its own `set_epoch` here).

    Args (`RandomSampler`'s, positional or by keyword, then `data_seed` by keyword):
        data_source: the dataset whose indices are drawn.
        replacement / num_samples: as for `RandomSampler`.
        generator: accepted for compatibility; the order never depends on its state.
        data_seed: the seed; defaults to `torch.initial_seed()` (set it with `set_seed`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Accelerate's signature: RandomSampler's arguments, plus `data_seed` by keyword.
        data_seed = kwargs.pop("data_seed", None)
        super().__init__(*args, **kwargs)
        self.initial_seed = int(data_seed) if data_seed is not None else torch.initial_seed()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the permutation of `epoch` on the next pass."""
        self.epoch = int(epoch)

    def epoch_indices(self) -> list[int]:
        """The whole order of the current epoch, then move on to the next epoch."""
        generator = torch.Generator()
        generator.manual_seed(self.initial_seed + self.epoch)
        order = draw_order(len(self.data_source), self.num_samples, self.replacement, generator)
        # Each pass moves to the next epoch, so a loop that never calls set_epoch still reshuffles.
        self.epoch += 1
        return order

    def __iter__(self) -> Iterator[int]:
        yield from self.epoch_indices()  # drawn at the first index, not when the iterator is made


def draw_order(size: int, count: int, replacement: bool, generator: torch.Generator) -> list[int]:
    """`count` indices below `size`: successive permutations, or draws with replacement."""
    if replacement:
        return torch.randint(high=size, size=(count,), dtype=torch.int64, generator=generator).tolist()
    order: list[int] = []
    while len(order) < count:
        order.extend(torch.randperm(size, generator=generator).tolist())
    del order[count:]
    return order


class PermutationSampler(RandomSampler):
    """A `RandomSampler` over its own generator that draws each epoch's order in one call.

    `prepare_data_loader` gives shuffled loaders one, seeded alike on every process;
    drawing the order at once (rather than one index at a time) keeps sharding cheap.
    """

    def __init__(
        self, data_source: Any, generator: torch.Generator, replacement: bool = False, num_samples: int | None = None
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)

    def epoch_indices(self) -> list[int]:
        """The whole order of one epoch."""
        return draw_order(len(self.data_source), self.num_samples, self.replacement, self.generator)

    def __iter__(self) -> Iterator[int]:
        yield from self.epoch_indices()  # drawn at the first index, not when the iterator is made


class SkipBatchSampler(Sampler):
    """`batch_sampler` without its first `skip_batches` batches (indices only, no data loaded)."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)

    @property
    def total_length(self) -> int:
        """Batches of the wrapped sampler, skipped ones included."""
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, sampler, set_epoch... are those of the wrapped sampler.
        if name == "batch_sampler":
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


class BatchSamplerShard(Sampler):
    """The batches of process `process_index` out of `batch_sampler`.

    Every process iterates the same `batch_sampler` (same order: seed it identically,
    or let the prepared loader synchronise its generator) and keeps its share:

    - `split_batches=False`: whole batches, dealt round-robin. Batches
      `[[0,1,2,3],[4,5,6,7]]` on 2 processes give process 0 `[0,1,2,3]` and process 1
      `[4,5,6,7]`.
    - `split_batches=True`: a slice of every batch. The same batches give process 0
      `[0,1]` then `[4,5]` and process 1 `[2,3]` then `[6,7]`. The batch size must
      be a multiple of `num_processes`.

    The end of the data, when it does not fill a last round (or a last batch) for
    every process:

    - if the batch sampler has `drop_last` set: the incomplete round is dropped;
    - else with `even_batches=True`: it is completed with indices from the start of
      the sampler, so every process yields the same number of batches, all of
      `batch_size` (the number of added indices is kept in `padding`). This holds on
      one process too: its short last batch is completed the same way;
    - else (`even_batches=False`): each process yields what is left for it, so the
      last batches differ (some processes may have one batch fewer).

    A batch sampler of varying batch sizes (no `batch_size`) has no size to even out:
    with `even_batches=True` the last round is completed with whole batches from the
    start of the sampler, so every process yields the same number of batches (as
    Accelerate does). A sampler that declares a `batch_size` but yields batches of
    other sizes is an error with `even_batches=True`.
    """

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        check_process(num_processes, process_index)
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        #: indices added to the last round of the latest pass to even it out (0: none)
        self.padding = 0
        if split_batches:
            if self.batch_size is None:
                raise ValueError(
                    "split_batches=True needs a batch sampler with a batch_size; "
                    f"{type(batch_sampler).__name__} has none"
                )
            if self.batch_size % num_processes != 0:
                raise ValueError(
                    "split_batches=True needs a batch size that is a round multiple of the number of processes: "
                    "batch_size="
                    f"{self.batch_size} cannot be split across num_processes={num_processes}. Use a batch size that "
                    f"is a multiple of {num_processes}, or split_batches=False."
                )

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped batch sampler or its sampler (whichever has `set_epoch`)."""
        for target in (self.batch_sampler, self.sampler):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                return

    def __len__(self) -> int:
        total, n, r = len(self.batch_sampler), self.num_processes, self.process_index
        if self.split_batches:
            if self.drop_last or self.even_batches:
                return total
            last = self._last_batch_size()
            if total == 0 or last is None or last == self.batch_size:
                return total
            return total - 1 + (1 if last > r * (self._fixed_size() // n) else 0)
        if self.drop_last:
            return total // n
        if self.even_batches:
            return math.ceil(total / n)
        return len(range(r, total, n))

    def _fixed_size(self) -> int:
        """The batch size, on the paths that only run with one (split batches, plain `BatchSampler`s)."""
        if self.batch_size is None:
            raise RuntimeError("BatchSamplerShard: a fixed batch size is needed here, the batch sampler has none")
        return int(self.batch_size)

    def _last_batch_size(self) -> int | None:
        """Size of the last batch of a standard `BatchSampler` over a sized sampler (None if unknown)."""
        if not isinstance(self.batch_sampler, BatchSampler):
            return None
        try:
            count = len(self.batch_sampler.sampler)  # type: ignore[arg-type]  # unsized samplers raise TypeError
        except TypeError:
            return None
        size = self._fixed_size()
        return count % size or size

    def __iter__(self) -> Iterator[list[Any]]:
        # A generator: nothing is drawn before the first batch is asked for, so an iterator
        # made and dropped (torchdata's StatefulDataLoader does, to fast-forward) costs no draw.
        self.padding = 0
        if self.num_processes == 1 and (self.drop_last or not self.even_batches or self.batch_size is None):
            yield from self.batch_sampler  # nothing to even out
            return
        indices = self._all_indices()
        if indices is not None:
            yield from self._iter_indices(indices)
        else:
            yield from self._iter_split() if self.split_batches else self._iter_rounds()

    def _all_indices(self) -> list[Any] | None:
        """The epoch's indices at once, when the wrapped sampler is a plain `BatchSampler` over a sized sampler.

        Draining the sampler in one `list()` and slicing this process's batches out of
        it costs less than assembling every process's batches one index at a time.
        """
        batch_sampler = self.batch_sampler
        if type(batch_sampler) is not BatchSampler:
            return None
        sampler = batch_sampler.sampler
        if hasattr(sampler, "epoch_indices"):
            return sampler.epoch_indices()
        try:
            len(sampler)  # type: ignore[arg-type]  # unsized samplers raise TypeError
        except TypeError:
            return None
        return list(sampler)

    def _iter_indices(self, indices: list[Any]) -> Iterator[list[Any]]:
        """This process's batches of a plain `BatchSampler` over `indices` (same result as the generic path)."""
        n, r, size = self.num_processes, self.process_index, self._fixed_size()
        count = len(indices)
        full = count // size
        short = 0 if self.drop_last else count % size
        if self.split_batches:
            share = size // n
            lo, hi = r * share, (r + 1) * share
            for start in range(0, full * size, size):
                yield indices[start + lo : start + hi]
            if not short:
                return
            last = indices[full * size :]
            if not self.even_batches:
                if short > lo:
                    yield last[lo:hi]
                return
            self.padding = size - short
            yield (last + cycle_to_length(indices[:size] if full else last, self.padding))[lo:hi]
            return
        rounds = full // n
        step = n * size
        for start in range(r * size, rounds * step, step):
            yield indices[start : start + size]
        if self.drop_last:
            return
        rest = indices[rounds * step : full * size + short]
        if not rest:
            return
        if not self.even_batches:
            if r * size < len(rest):
                yield rest[r * size : (r + 1) * size]
            return
        self.padding = step - len(rest)
        rest.extend(cycle_to_length(indices[:step], self.padding))
        yield rest[r * size : (r + 1) * size]

    def _varying(self, size: int, previous_short: bool) -> ValueError:
        return ValueError(
            f"even_batches=True needs every batch but the last to have batch_size={self.batch_size}, but the batch "
            f"sampler yielded a batch of {size} indices{' after a shorter one' if previous_short else ''}. "
            "Pass even_batches=False for batch samplers of varying batch sizes."
        )

    def _source_batches(self) -> Iterator[list[Any]]:
        """The wrapped sampler's batches; a plain `BatchSampler`'s cut here with C-level slicing (same, faster)."""
        batch_sampler = self.batch_sampler
        if type(batch_sampler) is not BatchSampler:
            yield from batch_sampler
            return
        indices, size = iter(batch_sampler.sampler), batch_sampler.batch_size
        while True:
            batch = list(itertools.islice(indices, size))
            if len(batch) < size:
                if batch and not batch_sampler.drop_last:
                    yield batch
                return
            yield batch

    def _iter_split(self) -> Iterator[list[Any]]:
        batch_size = self._fixed_size()
        share = batch_size // self.num_processes
        lo, hi = self.process_index * share, (self.process_index + 1) * share
        uneven = not self.even_batches and not self.drop_last
        first: list[Any] | None = None
        short: list[Any] | None = None
        for batch in self._source_batches():
            size = len(batch)
            if uneven:
                if size > lo:
                    yield batch[lo:hi]
                continue
            if self.even_batches and (short is not None or size > batch_size):
                raise self._varying(size, short is not None)
            if size == batch_size:
                if first is None:
                    first = batch
                yield batch[lo:hi]
            elif not self.drop_last:
                short = batch
        if short is None or self.drop_last:
            return
        # A short last batch, completed with indices from the start of the epoch.
        self.padding = batch_size - len(short)
        yield (list(short) + cycle_to_length(first if first is not None else short, self.padding))[lo:hi]

    def _iter_rounds(self) -> Iterator[list[Any]]:
        if self.batch_size is None:
            yield from self._iter_varying_rounds()
            return
        n, r, batch_size = self.num_processes, self.process_index, self.batch_size
        even, drop_last = self.even_batches, self.drop_last
        uneven = not even and not drop_last
        head_size = n * batch_size if even and not drop_last else 0
        head: list[Any] = []  # the first n * batch_size indices: what pads the last round
        pending: list[Any] = []  # batches of the round in progress
        short = False
        for batch in self._source_batches():
            size = len(batch)
            if even and (short or size > batch_size):
                raise self._varying(size, short)
            short = batch_size is not None and size != batch_size
            if len(head) < head_size:
                head.extend(batch)
            pending.append(batch)
            if len(pending) == n:
                if not short or uneven:
                    yield pending[r]
                    pending = []
                elif drop_last:
                    pending = []
                # else: a complete round ending short; it must be the last, padded below.
        if not pending or drop_last:
            return
        if uneven:
            if r < len(pending):
                yield pending[r]
            return
        indices = [i for batch in pending for i in batch]
        self.padding = n * batch_size - len(indices)
        indices.extend(cycle_to_length(head, self.padding))
        yield indices[r * batch_size : (r + 1) * batch_size]

    def _iter_varying_rounds(self) -> Iterator[list[Any]]:
        """Rounds of batches of any sizes; with `even_batches`, a last incomplete round completed with whole batches."""
        n, r = self.num_processes, self.process_index
        keep_head = self.even_batches and not self.drop_last
        head: list[list[Any]] = []  # the first n batches: what completes the last round
        pending: list[list[Any]] = []
        for batch in self.batch_sampler:
            if keep_head and len(head) < n:
                head.append(batch)
            pending.append(batch)
            if len(pending) == n:
                yield pending[r]
                pending = []
        if not pending or self.drop_last:
            return
        if not self.even_batches:
            if r < len(pending):
                yield pending[r]
            return
        added = cycle_to_length(head, n - len(pending))
        self.padding = sum(len(batch) for batch in added)
        pending.extend(added)
        yield pending[r]
