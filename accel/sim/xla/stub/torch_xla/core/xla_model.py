"""`torch_xla.core.xla_model` of the simulator: devices, ordinals and collectives on Gloo.

The XLA device is `torch.device("cpu")`. Collectives use the default process group,
which must be initialised first (`accel`'s `PartialState` does it through the `xla`
backend) unless there is a single replica, for which every collective is the identity;
replica sub-groups (`groups=`) are not simulated. Semantics follow
torch_xla's: `all_reduce` of a single tensor returns a new tensor, of a list reduces in
place; `all_gather` concatenates along `dim`; `rendezvous` is also a barrier.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import torch_xla._sim_state as _state
import torch_xla.runtime as xr

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

_REDUCE_OPS = {
    REDUCE_SUM: dist.ReduceOp.SUM,
    REDUCE_MUL: dist.ReduceOp.PRODUCT,
    REDUCE_AND: dist.ReduceOp.BAND,
    REDUCE_OR: dist.ReduceOp.BOR,
    REDUCE_MIN: dist.ReduceOp.MIN,
    REDUCE_MAX: dist.ReduceOp.MAX,
}


# -- devices and ordinals ----------------------------------------------------------------


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """The XLA device of this process (the CPU in the simulator)."""
    return torch.device("cpu")


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list[str]:
    """The XLA devices this process drives: one per replica under PJRT, as `xla:0`."""
    devices = ["xla:0"]
    return devices[:max_devices] if max_devices is not None else devices


def set_replication(device: Any, devices: list[Any] | None) -> None:
    """Nothing to set: under PJRT (and here) each process already drives its one device."""


def xla_device_hw(device: Any) -> str:
    """Hardware kind behind `device`: the simulated PJRT device type ("TPU")."""
    return xr.device_type()


def xrt_world_size(defval: int = 1) -> int:
    """Number of replicas in the job."""
    return xr.world_size()


def get_ordinal(defval: int = 0) -> int:
    """This replica's global ordinal."""
    return xr.global_ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    """This replica's ordinal on its host."""
    return xr.local_ordinal()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this is replica 0 of the host (`local=True`) or of the job."""
    return (get_local_ordinal() if local else get_ordinal()) == 0


def master_print(*args: Any, fd: Any = None, finalize: bool = False) -> None:
    """`print` (to `fd`, default the current `sys.stdout`) on the global master replica only."""
    if is_master_ordinal(local=False):
        print(*args, file=sys.stdout if fd is None else fd, flush=True)


# -- collectives ---------------------------------------------------------------------------


def _distributed(groups: Any) -> bool:
    """Whether collectives must go over the process group (False: a lone replica, no group)."""
    if groups:
        raise NotImplementedError(
            "torch_xla (accel simulator): replica groups (groups=...) are not simulated; "
            "collectives run over all replicas"
        )
    if dist.is_initialized():
        return True
    if xr.world_size() == 1:
        return False  # one replica: every collective is the identity, as on one TPU core
    raise RuntimeError(
        "torch_xla (accel simulator): no process group; create accel's PartialState() first, "
        "or torch.distributed.init_process_group('xla', init_method='xla://')"
    )


def all_reduce(reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None, pin_layout: bool = True) -> Any:
    """Reduce across replicas; a tensor gives a new tensor, a list is reduced in place and returned."""
    distributed = _distributed(groups)
    if reduce_type not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce_type {reduce_type!r}; use one of xm.REDUCE_* {sorted(_REDUCE_OPS)}")
    op = _REDUCE_OPS[reduce_type]
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs.clone()] if single else list(inputs)
    for tensor in tensors:
        if distributed:
            dist.all_reduce(tensor, op=op)
        if scale != 1.0:
            tensor.mul_(scale)
    return tensors[0] if single else inputs


def all_gather(
    value: torch.Tensor, dim: int = 0, groups: Any = None, output: torch.Tensor | None = None, pin_layout: bool = True
) -> torch.Tensor:
    """Concatenate every replica's equal-shaped `value` along `dim`."""
    value = value.contiguous()
    if _distributed(groups):
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, value)
        result = torch.cat(parts, dim=dim)
    else:
        result = value.clone()
    if output is not None:
        output.copy_(result)
        return output
    return result


def collective_broadcast(
    tensors: list[torch.Tensor], root_ordinal: int = 0, groups: Any = None, pin_layout: bool = True
) -> None:
    """Overwrite `tensors` in place on every replica with those of `root_ordinal`."""
    if not _distributed(groups):
        return
    for tensor in tensors:
        dist.broadcast(tensor, src=root_ordinal)


def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
    """Wait for every replica to reach `tag`; return every replica's `payload`, in ordinal order.

    Replicas that reach different tags fail with an error naming them (the real one hangs).
    """
    if not _distributed(replicas):
        return [bytes(payload)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tag, bytes(payload)))
    tags = [item[0] for item in gathered]
    if len(set(tags)) > 1:
        raise RuntimeError(f"xm.rendezvous: replicas met at different tags (by ordinal): {tags}")
    return [item[1] for item in gathered]


def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list[Any]], Any]) -> Any:
    """`reduce_fn` of the list of every replica's picklable `data` (through the CPU)."""
    if not _distributed(None):
        return reduce_fn([_to_cpu(data)])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tag, _to_cpu(data)))
    tags = {item[0] for item in gathered}
    if len(tags) > 1:
        raise RuntimeError(f"xm.mesh_reduce: replicas met at different tags: {sorted(tags)}")
    return reduce_fn([item[1] for item in gathered])


# -- training -------------------------------------------------------------------------------


def reduce_gradients(optimizer: torch.optim.Optimizer, groups: Any = None, pin_layout: bool = True) -> None:
    """Average the gradients of `optimizer`'s parameters over the replicas."""
    count = xrt_world_size()
    if count <= 1:
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        # One all-reduce per dtype, like XLA's fused reduction, instead of one per tensor.
        flat = torch.cat([g.reshape(-1) for g in same])
        all_reduce(REDUCE_SUM, [flat], scale=1.0 / count, groups=groups)
        offset = 0
        for grad in same:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict | None = None,
    groups: Any = None,
    pin_layout: bool = True,
) -> Any:
    """Reduce gradients across replicas, then `optimizer.step(**optimizer_args)`."""
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Cut the lazy graph; the simulator executes eagerly, so it only counts steps."""
    _state.steps += 1


def wait_device_ops(devices: list[Any] | None = None) -> None:
    """Wait for pending device work: none, the simulator is eager."""


def _to_cpu(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.cpu()
    if isinstance(data, dict):
        return type(data)({key: _to_cpu(value) for key, value in data.items()})
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_to_cpu(value) for value in data)
    return data


def save(data: Any, file_or_path: Any, master_only: bool = True, global_master: bool = False) -> None:
    """`torch.save` of `data` moved to the CPU, by the master replica only (unless `master_only=False`),
    then a rendezvous."""
    if not master_only or is_master_ordinal(local=not global_master):
        torch.save(_to_cpu(data), file_or_path)
    rendezvous("torch_xla.core.xla_model.save")


# -- random numbers ---------------------------------------------------------------------------


def set_rng_state(seed: int, device: Any = None) -> None:
    """Seed the (simulated) XLA generator."""
    _state.rng_seed = int(seed)


def get_rng_state(device: Any = None) -> int:
    """The (simulated) XLA generator's seed."""
    return _state.rng_seed
