"""`IterableDatasetShard`: the samples of one process out of an iterable dataset."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from accel.data.samplers import check_process, cycle_to_length


class IterableDatasetShard(IterableDataset):
    """The samples of process `process_index` out of `dataset`, which every process iterates identically.

    Samples are read in global batches (`batch_size * num_processes` samples, or
    `batch_size` with `split_batches=True`) and each process keeps its contiguous slice
    of each. On 2 processes, items `0..7` and `batch_size=4` give process 0
    `[0,1,2,3]` and process 1 `[4,5,6,7]`; with `split_batches=True`, process 0
    `[0,1,4,5]` and process 1 `[2,3,6,7]`. A process therefore always gets a whole
    number of its batches. An incomplete last global batch is dropped with
    `drop_last=True`, otherwise completed with samples from the start (their number is
    kept in `padding`).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        check_process(num_processes, process_index)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"IterableDatasetShard needs a positive batch_size, got {batch_size!r}")
        if split_batches and batch_size % num_processes != 0:
            raise ValueError(
                "split_batches=True needs a batch size that is a round multiple of the number of processes: "
                f"batch_size={batch_size} "
                f"cannot be split across num_processes={num_processes}. Use a batch size that is a multiple of "
                f"{num_processes}, or split_batches=False."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        #: samples added to the last global batch of the latest pass (0: none)
        self.padding = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    @property
    def process_batch_size(self) -> int:
        return self.batch_size // self.num_processes if self.split_batches else self.batch_size

    @property
    def total_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and forward it to the wrapped dataset if it has `set_epoch`."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def expected_padding(self) -> int:
        """Padding of the last global batch computed from the dataset's length (-1 if it has none)."""
        try:
            length = len(self.dataset)
        except TypeError:
            return -1
        return 0 if self.drop_last else -length % self.global_batch_size

    def __len__(self) -> int:
        rounds = len(self.dataset) / self.global_batch_size
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.process_batch_size

    def __iter__(self) -> Iterator[Any]:
        self.padding = 0
        size = self.global_batch_size
        lo = self.process_index * self.process_batch_size
        hi = lo + self.process_batch_size
        first: list[Any] | None = None
        buffer: list[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == size:
                yield from buffer[lo:hi]
                if first is None:
                    first = buffer
                buffer = []
        if not buffer or self.drop_last:
            return
        self.padding = size - len(buffer)
        buffer.extend(cycle_to_length(first if first is not None else list(buffer), self.padding))
        yield from buffer[lo:hi]
