"""Carried collectives: a simulated device's process group written in Python, carried by Gloo.

The simulated GPU's "nccl" group (`accel.sim.cuda.nccl.process_group`) and the simulated TPU's "xla"
group (the stand-in `torch_xla.distributed.xla_backend`) are both such groups: each
checks its device's rules with its device's words, hands the host tensors under the
device tensors (storage shared) to a `ProcessGroupGloo` of its own, and returns a finished
work holding the caller's device tensors (the results are already in them). What they
share is here: the group and its Gloo, the carrying on host tensors (gathering, broadcasting,
a contiguous copy written back), torch's older names of the collectives and coalesced calls
made one after another; the checks, the reductions and the buffers' layouts are each device's own.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from accel.sim.core.torch_internals import completed_work

__all__ = ["CarriedGroup", "PythonGroup", "carrier", "carry_with", "completed_work", "contiguous", "given"]

#: what carries the groups made from now on (empty: Gloo); a rank that stands in for absent
#: ranks (`accel.sim.cuda.nccl.stand_in`) carries them without peers
_carriers: list[Callable[..., Any]] = []


def carrier(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """What carries a group's collectives on the host tensors: a Gloo group of `size`, unless `carry_with` said."""
    if _carriers:
        return _carriers[0](store, rank, size, timeout)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def carry_with(make: Callable[..., Any] | None) -> None:
    """Carry the groups made from now on with `make(store, rank, size, timeout)` (None: with Gloo again)."""
    _carriers[:] = [make] if make is not None else []


#: the base class, typed loosely: torch's stubs declare its methods with overloads a
#: Python process group does not need to repeat
_ProcessGroup: Any = dist.ProcessGroup


class PythonGroup(_ProcessGroup):
    """Base of the simulator's process groups written in Python.

    Such a group has no C++ backend to keep its name and description in (torch's getter
    would raise "ProcessGroup name not set", e.g. for a subgroup): it keeps them itself.
    """

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")


def _forwarding(name: str) -> Callable[..., Any]:
    """A method that calls the group's method `name` with its arguments."""
    return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)


class CarriedGroup(PythonGroup):
    """A Python group whose collectives a Gloo group of its own (`_gloo`) carries, on the host tensors."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo: Any = carrier(store, rank, size, timeout)

    # -- carrying, on host tensors (whatever their device's rules and layouts) ----------------

    def _gathered(self, host: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
        """Every member's `host`, in group rank order (`count` tensors: Gloo refuses another count than the size)."""
        host = host.contiguous()
        parts = [torch.empty_like(host) for _ in range(self.size() if count is None else count)]
        self._gloo.allgather([parts], [host]).wait()
        return parts

    def _broadcast(self, host: torch.Tensor, root: int) -> None:
        """Group rank `root`'s `host` into every member's, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        with contiguous(host) as buffer:
            self._gloo.broadcast([buffer], options).wait()

    # -- torch 2.13 calls the collectives by their new names; these are the older ones ----------

    _allgather_base = _forwarding("all_gather_single")
    _reduce_scatter_base = _forwarding("reduce_scatter_single")
    alltoall_base = _forwarding("all_to_all_single")
    allgather_into_tensor_coalesced = _forwarding("all_gather_single_coalesced")
    reduce_scatter_tensor_coalesced = _forwarding("reduce_scatter_single_coalesced")

    # -- coalesced calls: one call after another (a device that checks them as one overrides) ------

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _pair_by_pair(self.all_gather_single, outputs, inputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _pair_by_pair(self.reduce_scatter_single, outputs, inputs, opts)


def _pair_by_pair(
    single: Callable[..., Any], outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
) -> Any:
    for output, input in zip(outputs, inputs, strict=True):
        single(output, input, opts)
    return completed_work(outputs)


@contextlib.contextmanager
def contiguous(host: torch.Tensor) -> Iterator[torch.Tensor]:
    """`host` as Gloo takes it: itself when contiguous, else a contiguous copy, written back into `host` after."""
    buffer = host.contiguous()
    yield buffer
    if buffer is not host:
        host.copy_(buffer)


def given(opts: Any) -> tuple[Any, ...]:
    """`opts` as the trailing arguments of a Gloo call: none when None (Gloo's bindings have their own defaults)."""
    return () if opts is None else (opts,)
