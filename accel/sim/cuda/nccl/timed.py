"""Collectives of the simulated "nccl" group on the clock (`accel.sim.cuda.timing`): each runs on its
group's NCCL stream after what the issuing stream had queued, and its work, once waited on, holds the
waiting stream until it ends, as ProcessGroupNCCL's work does (`WorkNCCL::synchronize`).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from accel.sim.core import torch_internals
from accel.sim.cuda.nccl import debug_log
from accel.sim.cuda.timing import ops as timing


class TimedWork(dist.Work):
    """A collective's work: finished as computed, and on the clock the waiting stream waits for its end."""

    def __init__(self, work: Any, index: int, end: float | None) -> None:
        super().__init__()
        self._work, self._index, self._end = work, index, end

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._work.wait()
        timing.stream_waits_for(self._index, self._end)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()

    def result(self) -> Any:
        return self._work.result()


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _first_gpu(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.device.index or 0 if value.device.type == "cuda" else None
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_gpu(item)
            if found is not None:
                return found
    return None


def group_ranks(group: Any) -> list[int] | int:
    """The global ranks of `group` (a simulated NCCL group), or its size when torch cannot name them."""
    known = getattr(group, "_sim_ranks", None)
    if known is not None:
        return known
    try:
        ranks: list[int] | int = dist.get_process_group_ranks(torch_internals.resolve_group(group.group_name))
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return group.size()  # not registered under a name (yet): its ranks taken as consecutive
    group._sim_ranks = ranks
    return ranks


#: while a CUDA graph is captured, each collective is issued through it (`torch_cuda.graphs`), which records it
captures: list[Callable[[Callable[..., Any], tuple, dict], Any]] = []


def timed(name: str, size: Callable[..., int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A collective method of the group, on the clock: `size(*args)` is its buffer as nccl-tests counts it."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        def issue(self: Any, *args: Any, **kwargs: Any) -> Any:
            work = method(self, *args, **kwargs)
            if not timing.running:
                return work
            index = _first_gpu(args)
            index = index if index is not None else (self.gpu or 0)
            end = timing.collective(name, size(self, *args), group_ranks(self), id(self), index)
            return TimedWork(work, index, end)

        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if debug_log.enabled():
                gpu = _first_gpu(args)
                debug_log.collective(self, method.__name__, args, gpu if gpu is not None else (self.gpu or 0))
            if captures:
                return captures[0](functools.partial(issue, self), args, kwargs)
            return issue(self, *args, **kwargs)

        return run

    return wrap


def first(self: Any, tensors: Any, *rest: Any) -> int:
    """The size of the first argument (all-reduce, broadcast, reduce, send, all-to-all, reduce-scatter's input)."""
    return _nbytes(tensors)


def second(self: Any, first_arg: Any, second_arg: Any, *rest: Any) -> int:
    """The size of the second argument (reduce-scatter's input)."""
    return _nbytes(second_arg)
