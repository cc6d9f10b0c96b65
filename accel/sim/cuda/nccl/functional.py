"""torch's functional collectives (`torch.ops._c10d_functional`) on simulated CUDA tensors.

DTensor, tensor parallelism and FSDP's gradient clipping communicate through the
functional collectives: ops that take a tensor and a group name and return a new tensor.
Their kernels would hand the group the CPU data under a simulated CUDA tensor, which the
simulated NCCL group refuses as NCCL refuses a CPU tensor. Here each is carried out with
the `torch.distributed` collective it stands for, on the simulated CUDA tensors themselves,
so the group (and the simulator's collective check) sees what a GPU run gives it. Values are
computed when the op is issued; the collective's work is kept with its output until `wait_tensor`,
where the waiting stream waits for it on the simulated clock (`accel.sim.cuda.timing`), as on a GPU.

Installed once per simulated GPU rank (`accel.sim.cuda.fake.install`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # defines _c10d_functional._wrap_tensor_autograd
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from accel.sim.core import torch_internals
from accel.sim.cuda.memory import report as memory_report
from accel.sim.cuda.tensors.cuda_tensor import unwrap

functional = torch.ops._c10d_functional

memory_report.collective_source(__file__)  # the buffers this module's code makes are collective buffers


#: a functional collective's output storage -> its work, until `wait_tensor` on it (or on a view of it, as
#: c10d finds the work by the tensor's storage) waits; works never waited on are let go, oldest first
_pending: dict[int, Any] = {}
_PENDING_KEPT = 4096


def _storage_key(tensor: torch.Tensor) -> int:
    return torch_internals.storage_key(unwrap(tensor))


def _issued(out: torch.Tensor, work: Any) -> torch.Tensor:
    """`out` of a collective issued as `work`: waited on where the program waits for it (`_wait`)."""
    if work is not None:
        _pending[_storage_key(out)] = work
        if len(_pending) > _PENDING_KEPT:
            del _pending[next(iter(_pending))]
    return out


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    work = _pending.pop(_storage_key(tensor), None) if _pending else None
    if work is not None:
        work.wait()
    return tensor


def _op(name: str) -> dist.ReduceOp:
    """The `ReduceOp` a functional collective names in lower case ("sum", "avg", ...)."""
    try:
        return getattr(dist.ReduceOp, name.upper())
    except AttributeError:
        raise ValueError(f"unknown reduce op {name!r} given to a functional collective") from None


def _group(name: Any) -> Any:
    return torch_internals.resolve_group(name)


def _all_reduce_(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    return _issued(tensor, dist.all_reduce(tensor, op=_op(op), group=_group(group), async_op=True))


def _all_gather(tensor: torch.Tensor, size: int, group: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    tensor = tensor.contiguous()
    if out is None:
        out = tensor.new_empty((tensor.size(0) * size, *tensor.shape[1:]))
    return _issued(out, dist.all_gather_single(out, tensor, group=_group(group), async_op=True))


def _reduce_scatter(
    tensor: torch.Tensor, op: str, size: int, group: Any, out: torch.Tensor | None = None
) -> torch.Tensor:
    tensor = tensor.contiguous()
    if out is None:
        if tensor.size(0) % size:
            raise ValueError(
                f"reduce_scatter_tensor: the first dimension of the input ({tensor.size(0)}) must be divisible by "
                f"the group size ({size})"
            )
        out = tensor.new_empty((tensor.size(0) // size, *tensor.shape[1:]))
    reduce_op = _op(op)
    if tensor.is_complex():
        # NCCL reduces complex numbers as pairs of reals, for the ops that allow it (c10d's own rule)
        if not dist.supports_complex(reduce_op):
            raise ValueError(f"reduce_scatter_tensor does not support {reduce_op} on complex tensors")
        real_out, real_in = torch.view_as_real(out), torch.view_as_real(tensor)
        work = dist.reduce_scatter_single(real_out, real_in, op=reduce_op, group=_group(group), async_op=True)
        return _issued(out, work)
    return _issued(out, dist.reduce_scatter_single(out, tensor, op=reduce_op, group=_group(group), async_op=True))


def _all_to_all(tensor: torch.Tensor, out_splits: list, in_splits: list, group: Any) -> torch.Tensor:
    tensor = tensor.contiguous()
    rows = sum(out_splits) if out_splits else tensor.size(0)
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    splits = (list(out_splits) or None, list(in_splits) or None)
    return _issued(out, dist.all_to_all_single(out, tensor, *splits, group=_group(group), async_op=True))


def _broadcast_(tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    return _issued(tensor, dist.broadcast(tensor, group_src=src, group=_group(group), async_op=True))


def _shard_dim_alltoall(tensor: torch.Tensor, gather_dim: int, shard_dim: int, group: Any) -> torch.Tensor:
    # Gathered whole, then this rank's shard: the same values as NCCL's all-to-all gives.
    pg = _group(group)
    size = dist.get_world_size(pg)
    parts = [torch.empty_like(tensor.contiguous()) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=pg)
    whole = torch.cat(parts, dim=gather_dim)
    return whole.chunk(size, dim=shard_dim)[dist.get_rank(pg)].contiguous()


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


def _refused(name: str) -> Callable[..., Any]:
    def refuse(args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError(
            f"torch.ops._c10d_functional.{name} is not available on simulated GPUs: use torch.distributed's "
            "send/recv or batch_isend_irecv, which are"
        )

    return refuse


def handlers() -> dict[Any, Callable[[tuple, dict], Any]]:
    """Functional collective op -> its handler `(args, kwargs) -> result` on simulated CUDA tensors."""
    return {
        functional.all_reduce.default: lambda a, k: _all_reduce_(_copy(a[0]), a[1], a[2]),
        functional.all_reduce_.default: lambda a, k: _all_reduce_(a[0], a[1], a[2]),
        functional.all_reduce_coalesced.default: lambda a, k: [_all_reduce_(_copy(t), a[1], a[2]) for t in a[0]],
        functional.all_reduce_coalesced_.default: lambda a, k: [_all_reduce_(t, a[1], a[2]) for t in a[0]],
        functional.all_gather_into_tensor.default: lambda a, k: _all_gather(a[0], a[1], a[2]),
        functional.all_gather_into_tensor_out.default: lambda a, k: _all_gather(a[0], a[1], a[2], k["out"]),
        functional.all_gather_into_tensor_coalesced.default: lambda a, k: [_all_gather(t, a[1], a[2]) for t in a[0]],
        functional.reduce_scatter_tensor.default: lambda a, k: _reduce_scatter(a[0], a[1], a[2], a[3]),
        functional.reduce_scatter_tensor_out.default: lambda a, k: _reduce_scatter(a[0], a[1], a[2], a[3], k["out"]),
        functional.reduce_scatter_tensor_coalesced.default: lambda a, k: [
            _reduce_scatter(t, a[1], a[2], a[3]) for t in a[0]
        ],
        functional.all_to_all_single.default: lambda a, k: _all_to_all(a[0], a[1], a[2], a[3]),
        functional.broadcast.default: lambda a, k: _broadcast_(_copy(a[0]), a[1], a[2]),
        functional.broadcast_.default: lambda a, k: _broadcast_(a[0], a[1], a[2]),
        functional.wait_tensor.default: lambda a, k: _wait(a[0]),  # computed when issued; waited on the clock
        # funcol wraps each result for a later wait, as on a GPU (`redistribute(async_op=True)` gives one); made
        # around the simulated CUDA tensor itself: made on the inner CPU tensor, that wrapper (a tensor without
        # storage) would become the data of the simulated CUDA tensor
        functional._wrap_tensor_autograd.default: lambda a, k: AsyncCollectiveTensor(a[0]),
        functional.isend.default: _refused("isend"),
        functional.irecv.default: _refused("irecv"),
        functional.batch_p2p_ops.default: _refused("batch_p2p_ops"),
        torch.ops._dtensor.shard_dim_alltoall.default: lambda a, k: _shard_dim_alltoall(a[0], a[1], a[2], a[3]),
    }
