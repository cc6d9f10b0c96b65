"""A process group that carries simulated CUDA tensors over Gloo.

Gloo moves CPU tensors only, and DDP's C++ reducer hands its process group the
gradient buckets it allocated on the model's device. This group, written in Python,
takes CUDA tensors of simulated GPUs (and CPU tensors, like a "cpu:gloo,cuda:nccl"
group), gives Gloo the CPU data under them (same storage, so results land in place),
and waits for Gloo before returning. It is the default group of simulated GPU ranks
under the name `BACKEND_NAME`; the NCCL-like group of issue 8 item 4 (which refuses CPU
tensors, as NCCL does) builds on the same idea.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _options

from accel.sim import torch_internals
from accel.sim.cuda_tensor import unwrap

#: the name under which `torch.distributed` knows this group
BACKEND_NAME = "accel_sim_cuda"


def _cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [unwrap(t) for t in tensors]


def _cpu_lists(lists: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [_cpu(tensors) for tensors in lists]


def _finished(work: Any, result: Any) -> Any:
    # Gloo's work holds the CPU tensors; the caller's future must hold its own tensors.
    work.wait()
    return torch_internals.completed_work(result)


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


class SimCudaGroup(PythonGroup):
    """Collectives on simulated CUDA (and CPU) tensors, carried by a Gloo group of the same ranks."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo: Any = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # torch's name
        return BACKEND_NAME

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _finished(self._gloo.allreduce(_cpu(tensors), opts or dist.AllreduceOptions()), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        options = opts or dist.AllreduceCoalescedOptions()
        return _finished(self._gloo.allreduce_coalesced(_cpu(tensors), options), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _finished(self._gloo.broadcast(_cpu(tensors), opts or dist.BroadcastOptions()), tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        options = opts or _options.AllgatherOptions()
        return _finished(self._gloo.allgather(_cpu_lists(outputs), _cpu(inputs), options), outputs)

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        options = opts or _options.AllgatherOptions()
        return _finished(self._gloo._allgather_base(unwrap(output), unwrap(tensor), options), [output])

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, tensor, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        options = opts or dist.ReduceScatterOptions()
        return _finished(self._gloo.reduce_scatter(_cpu(outputs), _cpu_lists(inputs), options), outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        options = opts or dist.ReduceScatterOptions()
        return _finished(self._gloo._reduce_scatter_base(unwrap(output), unwrap(tensor), options), [output])

    def reduce_scatter_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, tensor, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _finished(self._gloo.reduce(_cpu(tensors), opts or dist.ReduceOptions()), tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        options = opts or dist.GatherOptions()
        return _finished(self._gloo.gather(_cpu_lists(outputs), _cpu(inputs), options), outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        options = opts or dist.ScatterOptions()
        return _finished(self._gloo.scatter(_cpu(outputs), _cpu_lists(inputs), options), outputs)

    def alltoall_base(
        self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list, input_splits: list, opts: Any = None
    ) -> Any:
        options = opts or dist.AllToAllOptions()
        work = self._gloo.alltoall_base(unwrap(output), unwrap(tensor), output_splits, input_splits, options)
        return _finished(work, [output])

    def all_to_all_single(
        self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list, input_splits: list, opts: Any = None
    ) -> Any:
        return self.alltoall_base(output, tensor, output_splits, input_splits, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return _finished(self._gloo.send(_cpu(tensors), dst, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return _finished(self._gloo.recv(_cpu(tensors), src, tag), tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _finished(self._gloo.barrier(opts or dist.BarrierOptions()), [])


def register() -> None:
    """Make `init_process_group(BACKEND_NAME)` create a `SimCudaGroup` (once per process)."""
    if BACKEND_NAME.upper() in dist.Backend.backend_list or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, SimCudaGroup, devices=["cpu", "cuda"])
