"""Carried collectives: a simulated device's process group written in Python, carried by Gloo.

The simulated GPU's "nccl" group (`accel.sim.cuda.nccl_group`) and the simulated TPU's "xla"
group (the stand-in `torch_xla.distributed.xla_backend`) are both such groups: each
checks its device's rules with its device's words, hands the host tensors under the
device tensors (storage shared) to a `ProcessGroupGloo` of its own, and returns a finished
work holding the caller's device tensors (the results are already in them). What they
share is here; the checks, the reductions and the way each collective lays out its
buffers are each device's own.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from accel.sim.core.torch_internals import completed_work

__all__ = ["CarriedGroup", "PythonGroup", "completed_work", "given"]

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


class CarriedGroup(PythonGroup):
    """A Python group whose collectives a Gloo group of its own (`_gloo`) carries, on the host tensors."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo: Any = dist.ProcessGroupGloo(store, rank, size, timeout)


def given(opts: Any) -> tuple[Any, ...]:
    """`opts` as the trailing arguments of a Gloo call: none when None (Gloo's bindings have their own defaults)."""
    return () if opts is None else (opts,)
