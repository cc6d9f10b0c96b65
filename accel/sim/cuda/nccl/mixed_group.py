"""The simulated GPU's "cpu:gloo,cuda:nccl" group: CPU tensors over Gloo, CUDA tensors NCCL's way.

On a GPU node, `init_process_group("cpu:gloo,cuda:nccl")` (torchtitan's choice, to save
checkpoints of CPU tensors) gives a group that sends each collective to the backend of
its tensors' device. In a simulated GPU rank that group is a `SimCudaGroup`, registered
under `BACKEND_NAME`: a collective on CPU tensors is Gloo's own (its checks, its work
objects, under way when returned), one on simulated CUDA tensors is the simulated NCCL
group's (`accel.sim.cuda.nccl.process_group`: NCCL's shapes, reductions and refusals), each on a Gloo
group of its own, as the two backends are two communicators on a GPU node (DCP's
`async_save` runs its CPU collectives in a thread while training runs the GPUs'). A CPU
tensor among CUDA ones is refused as NCCL refuses it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from accel.sim.core import torch_internals
from accel.sim.core.carried import PythonGroup, carrier, given
from accel.sim.core.torch_internals import gloo_all_gather_single, gloo_reduce_scatter_single
from accel.sim.core.wrapper import tensors_in
from accel.sim.cuda.nccl.process_group import MIXED_BACKEND, SimNcclGroup
from accel.sim.cuda.tensors.cuda_tensor import is_simulated_cuda

__all__ = ["BACKEND_NAME", "PythonGroup", "SimCudaGroup", "register"]

#: the name under which `torch.distributed` knows this group
BACKEND_NAME = MIXED_BACKEND


def _on_cpu(args: tuple, count: int) -> bool:
    """Whether the first `count` arguments of a call (its tensors) are all CPU tensors."""
    tensors = tensors_in(list(args[:count]))
    return bool(tensors) and not any(is_simulated_cuda(t) for t in tensors)


def _pairwise(single: Callable[..., Any]) -> Callable[..., Any]:
    """The coalesced form of Gloo's collective `single` (which Gloo's Python binding lacks): one call per pair."""

    def run(gloo: Any, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs, strict=True):
            single(gloo, output, input, *given(opts)).wait()
        return torch_internals.completed_work(outputs)

    return run


#: group method -> (how many leading arguments hold its tensors, what runs it on Gloo for CPU tensors)
_CPU_ROUTES: dict[str, tuple[int, Callable[..., Any]]] = {
    **{
        name: (1, lambda gloo, *args, _name=name: getattr(gloo, _name)(*args))
        for name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "send", "recv", "recv_anysource")
    },
    **{
        name: (2, lambda gloo, *args, _name=name: getattr(gloo, _name)(*args))
        for name in ("allgather", "allgather_coalesced", "reduce_scatter", "gather", "scatter", "alltoall")
    },
    "all_gather_single": (2, gloo_all_gather_single),
    "reduce_scatter_single": (2, gloo_reduce_scatter_single),
    "all_to_all_single": (2, lambda gloo, *args: gloo.alltoall_base(*args)),
    "all_gather_single_coalesced": (2, _pairwise(gloo_all_gather_single)),
    "reduce_scatter_single_coalesced": (2, _pairwise(gloo_reduce_scatter_single)),
}
#: torch's other names for the same methods
_ALIASES = {
    "_allgather_base": "all_gather_single",
    "_reduce_scatter_base": "reduce_scatter_single",
    "alltoall_base": "all_to_all_single",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
}


def _routed(name: str) -> Callable[..., Any]:
    """Group method `name`: Gloo's for CPU tensors, the simulated NCCL group's otherwise."""
    count, on_gloo = _CPU_ROUTES[_ALIASES.get(name, name)]
    on_nccl = getattr(SimNcclGroup, name)

    def method(self: SimCudaGroup, *args: Any) -> Any:
        if not _on_cpu(args, count):
            return on_nccl(self, *args)
        while args and args[-1] is None:  # Gloo's bindings have their own default options
            args = args[:-1]
        work = on_gloo(self._cpu_gloo, *args)
        if name in ("send", "recv", "recv_anysource") and self._coalesced is not None:
            self._coalesced.append(work)
        return work

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"`{name}`: Gloo's for CPU tensors, NCCL's (simulated) for CUDA tensors."
    return method


class SimCudaGroup(SimNcclGroup):
    """Collectives on CPU tensors by Gloo, on simulated CUDA tensors as the simulated NCCL group runs them."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(store, rank, size, timeout)
        # The CPU backend's own communicator, as on a GPU node (Gloo beside NCCL): collectives on
        # CPU tensors (async_save's, from its thread) may run while the GPUs' run (training).
        self._cpu_gloo: Any = carrier(dist.PrefixStore("cpu/", store), rank, size, timeout)

    def getBackendName(self) -> str:  # torch's name
        return BACKEND_NAME

    @property
    def _device_types(self) -> list[torch.device]:
        # both backends' devices; torch's object collectives then pick the CPU, as for this string on a GPU node
        return [torch.device("cpu"), torch.device("cuda")]

    def _get_backend(self, device: Any) -> Any:
        """Gloo for the CPU, this group for CUDA."""
        return self._cpu_gloo if torch.device(device).type == "cpu" else super()._get_backend(device)


for _name in (*_CPU_ROUTES, *_ALIASES):
    setattr(SimCudaGroup, _name, _routed(_name))


def register() -> None:
    """Make `init_process_group(BACKEND_NAME)` create a `SimCudaGroup` (once per process)."""
    if BACKEND_NAME.upper() in dist.Backend.backend_list or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, SimCudaGroup, devices=["cpu", "cuda"])
