"""`torch_xla.core.xla_model` (`xm`) of the simulator: torch_xla's functions and their semantics.

Devices come from `accel.sim.xla.bridge` (one XLA device per process, as under PJRT).
Collectives are torch_xla's: `all_reduce` of a tensor returns a new tensor, of a list
reduces in place and returns the list; with one replica they do nothing (no `scale`
either), as torch_xla's; `groups=` (replica groups) are supported. Each one runs through
`torch.distributed` on an "xla" process group (`torch_xla.distributed.xla_backend`),
which hands host copies of the tensors to Gloo: the simulator's collective check and
deadlock detection see every call.

Not in today's torch_xla, so not here either: `xrt_world_size`, `get_ordinal` and
`parse_xla_device` (removed in torch_xla 2.7): an `AttributeError` names what replaced them.
Refused by name: `send` / `recv` with channel ids, `get_memory_info` (no TPU memory model).
The simulator runs eagerly: `torch_xla.sync` / `mark_step` cut no graph (they count steps
and run the step closures), `wait_device_ops` has nothing to wait for.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_xla
import torch_xla._sim_state as _state
import torch_xla.runtime as runtime
import torch_xla.utils.utils as xu
from accel.sim.xla import bridge

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

#: names removed from today's torch_xla -> what replaced them
_REMOVED = {
    "xrt_world_size": "torch_xla.runtime.world_size()",
    "get_ordinal": "torch_xla.runtime.global_ordinal()",
    "parse_xla_device": "torch_xla._internal.utils.parse_xla_device()",
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise AttributeError(
            f"module 'torch_xla.core.xla_model' has no attribute {name!r} (removed in torch_xla 2.7; "
            f"use {_REMOVED[name]})"
        )
    raise AttributeError(f"module 'torch_xla.core.xla_model' has no attribute {name!r}")


def _deprecated(message: str) -> None:
    # What typing_extensions.deprecated (torch_xla's decorator) warns at each call.
    warnings.warn(message, DeprecationWarning, stacklevel=3)


# -- devices and ordinals ----------------------------------------------------------------


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives on an XLA device."""
    return bridge.is_xla_tensor(tensor)


def get_xla_supported_devices(max_devices: int | None = None) -> list[str]:
    """The XLA devices this process drives: one, under PJRT as here."""
    devices = [str(bridge.xla_device())]
    return devices[:max_devices] if max_devices else devices


def get_local_ordinal() -> int:
    """This replica's ordinal on its host."""
    return runtime.local_ordinal()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this is replica 0 of the host (`local=True`) or of the job."""
    ordinal = get_local_ordinal() if local else runtime.global_ordinal()
    return ordinal == 0


def master_print(*args: Any, fd: TextIO | None = None, local: bool = False, flush: bool = False) -> None:
    """`print` (to `fd`, default `sys.stdout`) on the master replica (of the job, or of the host with `local`)."""
    if is_master_ordinal(local=local):
        print(*args, file=sys.stdout if fd is None else fd, flush=flush)


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """Deprecated in torch_xla (use `torch_xla.device()`): this process's XLA device."""
    _deprecated("Use torch_xla.device instead")
    return torch_xla.device(n)


def _check_device(device: Any) -> str:
    text = str(device)
    if text not in get_xla_supported_devices() and not text.startswith("xla:"):
        raise RuntimeError(f"Invalid device format: {text}")
    return text


def xla_real_devices(devices: list[Any] | None = None) -> list[str]:
    """The real devices behind `devices` (default: this process's), e.g. ['TPU:3']."""
    for device in devices or get_xla_supported_devices():
        _check_device(device)
    return torch_xla.real_devices()


def xla_device_hw(device: Any) -> str:
    """Hardware kind behind `device`: the simulated PJRT device type ("TPU")."""
    _check_device(device)
    return str(runtime.device_type())


def xla_device_kind(device: Any = None) -> str:
    """The vendor's name of the chip: the simulator says which it is."""
    return f"{runtime.device_type()} (accel simulator)"


def set_replication(device: Any, devices: list[Any] | None) -> None:
    """Nothing to set up: under PJRT (and here) each process already drives its one device."""
    for item in devices or []:
        _check_device(item)


def unlazy(tensors: list[torch.Tensor]) -> None:
    """Materialise `tensors`: they are, the simulator runs eagerly."""


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """Keep the compiler from moving work across this point: there is no compiler here."""


class RateTracker:
    """Rate of `add`-ed counts per second, smoothed (torch_xla's `xm.RateTracker`)."""

    def __init__(self, smooth_factor: float | None = None) -> None:
        self._smooth_factor = (
            xu.getenv_as("RATE_TRACKER_SMOOTHING", float, 0.4) if smooth_factor is None else smooth_factor
        )
        self._start_time = time.time()
        self._partial_time = self._start_time
        self._partial_count = 0.0
        self._partial_rate: float | None = None
        self._count = 0.0

    def _update(self, now: float, rate: float) -> None:
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = rate

    def add(self, count: float) -> None:
        self._count += count

    def _smooth(self, current_rate: float) -> float:
        if self._partial_rate is None:
            return current_rate
        return (1 - self._smooth_factor) * current_rate + self._smooth_factor * self._partial_rate

    def rate(self) -> float:
        now = time.time()
        delta = now - self._partial_time
        report_rate = 0.0
        if delta > 0:
            report_rate = self._smooth(self._count / delta)
            self._update(now, report_rate)
        return report_rate

    def global_rate(self) -> float:
        delta = time.time() - self._start_time
        count = self._partial_count + self._count
        return count / delta if delta > 0 else 0.0


# -- collectives ---------------------------------------------------------------------------


def _alone() -> bool:
    return runtime.world_size() == 1 and not xu.getenv_as("XLA_ALWAYS_ALLREDUCE", bool, False)


def _group(groups: Sequence[Sequence[int]] | None, op: str) -> Any:
    """The process group of xm's collective `op` over `groups` (made by the first `op` that needs it)."""
    from torch_xla.distributed import xla_backend

    return xla_backend.sub_group(groups, op) if groups else xla_backend.replica_group(op)


def _group_size(groups: Sequence[Sequence[int]] | None) -> int:
    if groups:
        sizes = {len(g) for g in groups}
        assert len(sizes) == 1, "Replica groups must have the same number of replicas/shards."
        return sizes.pop()
    return runtime.world_size()


def _reduce_op(reduce_type: str) -> Any:
    if reduce_type not in _REDUCE_OPS:
        raise ValueError(f"Invalid reduce type {reduce_type!r}: one of xm.REDUCE_* ({', '.join(_REDUCE_OPS)})")
    return _REDUCE_OPS[reduce_type]


def _check_xla(tensors: Sequence[torch.Tensor]) -> None:
    from torch_xla.distributed import xla_backend

    xla_backend.check_xla(tensors)


def _all_reduce_in_place(tensors: list[torch.Tensor], op: Any, scale: float, group: Any) -> None:
    # One collective per dtype (XLA reduces the list as one fused op), not one per tensor.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        if len(same) == 1 and same[0].is_contiguous():
            flat = same[0]
            dist.all_reduce(flat, op=op, group=group)
        else:
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.all_reduce(flat, op=op, group=group)
        if scale != 1.0:
            # XLA multiplies by the scale as a constant of the tensor's type (an integer one truncates it).
            flat.mul_(scale if flat.is_floating_point() or flat.is_complex() else int(scale))
        if flat is not same[0]:
            offset = 0
            with torch.no_grad():
                for tensor in same:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


def all_reduce(
    reduce_type: str,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups: list[list[int]] | None = None,
    pin_layout: bool = True,
) -> Any:
    """Reduce across replicas; a tensor gives a new tensor, a list is reduced in place and returned."""
    op = _reduce_op(reduce_type)
    if _alone():
        return inputs.clone() if isinstance(inputs, torch.Tensor) else inputs
    tensors: list[torch.Tensor] = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    _check_xla(tensors)
    group = _group(groups, "all_reduce")
    with torch.no_grad():
        if isinstance(inputs, torch.Tensor):
            result = inputs.clone()
            _all_reduce_in_place([result], op, scale, group)
            return result
        _all_reduce_in_place(tensors, op, scale, group)
    return inputs


def _gather_tensor(value: torch.Tensor, dim: int, groups: list[list[int]] | None) -> torch.Tensor:
    if dim < 0:
        dim = value.dim() + dim
    if _alone():
        return value.clone()
    _check_xla([value])
    value = value.contiguous()
    parts = [torch.empty_like(value) for _ in range(_group_size(groups))]
    dist.all_gather(parts, value, group=_group(groups, "all_gather"))
    return torch.cat(parts, dim=dim)


def all_gather(
    value: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    groups: list[list[int]] | None = None,
    output: Any = None,
    pin_layout: bool = True,
    channel_id: int | None = None,
    use_global_device_ids: bool | None = None,
) -> Any:
    """Concatenate every replica's `value` along `dim` (a list of tensors: each one, with `pin_layout=False`)."""
    if _is_tensor_list(value) and pin_layout:
        raise RuntimeError("For xm.all_gather with list of tensors input, pin_layout=True is not yet supported.")
    return _each_into_output("value", value, output, lambda v: _gather_tensor(v, dim, groups))


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value)


def _each_into_output(name: str, value: Any, output: Any, collective: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`collective` of a tensor `value`, or of each tensor of a list (a list of results), as torch_xla's
    `all_gather` / `reduce_scatter`: with `output` (a tensor, or a list as long), written there and returned."""
    if isinstance(value, torch.Tensor):
        outputs, inputs = [output], [value]
    elif _is_tensor_list(value):
        if output is not None:
            if not _is_tensor_list(output):
                raise TypeError(f"`output` needs to be a list of Tensors, but given {type(output)}.")
            if len(output) != len(value):
                raise ValueError(f"`output` length doesn't match `input` length: {len(output)} vs {len(value)}.")
        outputs, inputs = output, value
    else:
        raise TypeError(f"`{name}` needs to be a Tensor or a list of Tensors, but given {type(value)}.")
    results = [collective(v) for v in inputs]
    if output is None:
        return results[0] if isinstance(value, torch.Tensor) else results
    with torch.no_grad():
        for out, result in zip(outputs, results, strict=True):
            out.copy_(result)
    return output


def _reduce_scatter_tensor(
    op: Any, value: torch.Tensor, scale: float, scatter_dim: int, shard_count: int, groups: Any
) -> torch.Tensor:
    if scatter_dim < 0:
        scatter_dim += value.dim()
    expected = 1 if _alone() else _group_size(groups)
    if shard_count != expected:
        raise RuntimeError(
            f"xm.reduce_scatter: shard_count={shard_count}, but the replica group has {expected} replicas "
            "(XLA's ReduceScatter splits the input in as many shards as there are replicas in the group)"
        )
    if value.size(scatter_dim) % shard_count:
        raise RuntimeError(
            f"xm.reduce_scatter: dimension {scatter_dim} of the input (size {value.size(scatter_dim)}) is not "
            f"divisible by shard_count={shard_count}"
        )
    with torch.no_grad():
        if _alone():
            result = value.clone()
        else:
            _check_xla([value])
            moved = value.movedim(scatter_dim, 0).contiguous()
            out = torch.empty((moved.size(0) // shard_count, *moved.shape[1:]), dtype=value.dtype, device=value.device)
            # reduce_scatter_single: reduce_scatter_tensor calls it, and torch 2.14 deprecates that name
            dist.reduce_scatter_single(out, moved, op=op, group=_group(groups, "reduce_scatter"))
            result = out.movedim(0, scatter_dim)
        if scale != 1.0:
            result = result * (scale if result.is_floating_point() or result.is_complex() else int(scale))
    return result


def reduce_scatter(
    reduce_type: str,
    input: torch.Tensor | list[torch.Tensor],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: list[list[int]] | None = None,
    output: Any = None,
    pin_layout: bool = True,
    channel_id: int | None = None,
    use_global_device_ids: bool | None = None,
) -> Any:
    """Reduce across replicas, then give each replica its shard of `scatter_dim` (scaled by `scale`)."""
    op = _reduce_op(reduce_type)
    return _each_into_output(
        "input", input, output, lambda v: _reduce_scatter_tensor(op, v, scale, scatter_dim, shard_count, groups)
    )


def all_to_all(
    value: torch.Tensor,
    split_dimension: int,
    concat_dimension: int,
    split_count: int,
    groups: list[list[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """XLA's AllToAll: split `value` in `split_count` along `split_dimension`, send the i-th piece to replica i
    of the group, and concatenate the pieces received along `concat_dimension`."""
    size = 1 if _alone() else _group_size(groups)
    if split_count != size:
        raise RuntimeError(f"xm.all_to_all: split_count={split_count}, but the replica group has {size} replicas")
    if value.size(split_dimension) % split_count:
        raise RuntimeError(
            f"xm.all_to_all: dimension {split_dimension} of the input (size {value.size(split_dimension)}) is not "
            f"divisible by split_count={split_count}"
        )
    pieces = list(torch.chunk(value, split_count, dim=split_dimension))
    with torch.no_grad():
        if size > 1:
            _check_xla([value])
            sent = torch.stack([p.contiguous() for p in pieces]).contiguous()
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, group=_group(groups, "all_to_all"))
            pieces = list(received.unbind(0))
        return torch.cat(pieces, dim=concat_dimension)


def collective_permute(value: torch.Tensor, pairs: list[list[int]]) -> torch.Tensor:
    """XLA's CollectivePermute: each (source, target) pair sends source's `value` to target; a replica no
    pair targets gets zeros."""
    sources = [int(s) for s, _ in pairs]
    targets = [int(t) for _, t in pairs]
    world = runtime.world_size()
    for name, ids in (("source", sources), ("target", targets)):
        if len(set(ids)) != len(ids) or any(not 0 <= i < world for i in ids):
            raise RuntimeError(
                f"xm.collective_permute: each {name} replica must appear at most once and be in [0, {world}); "
                f"got pairs {pairs}"
            )
    me = runtime.global_ordinal()
    with torch.no_grad():
        # Every replica takes part in the collective (as in XLA), also those no pair names.
        parts = [value.clone()] if _alone() else None
        if parts is None:
            _check_xla([value])
            contiguous = value.contiguous()
            parts = [torch.empty_like(contiguous) for _ in range(world)]
            dist.all_gather(parts, contiguous, group=_group(None, "collective_permute"))
        for source, target in zip(sources, targets, strict=True):
            if target == me:
                return parts[source].clone()
        return torch.zeros_like(value)


def collective_broadcast(
    tensors: list[torch.Tensor], root_ordinal: int = 0, groups: list[list[int]] | None = None, pin_layout: bool = True
) -> None:
    """Overwrite `tensors` in place on every replica with those of `root_ordinal` (the others' zeroed, then a sum
    over the replicas, as torch_xla does).

    torch_xla multiplies the others' tensors by 0; here they are zeroed, because a buffer from
    `torch.empty` on the simulated device holds whatever the host memory held (NaN included),
    where XLA's holds zeros.
    """
    with torch.no_grad():
        if runtime.global_ordinal() != root_ordinal:
            for tensor in tensors:
                tensor.zero_()
    all_reduce(REDUCE_SUM, tensors, groups=groups, pin_layout=pin_layout)


def send(value: torch.Tensor, channel_id: int) -> torch.Tensor:
    """Refused: XLA's Send with channel ids is not simulated."""
    raise NotImplementedError(
        "xm.send (accel simulator): XLA Send/Recv with channel ids is not simulated; use "
        "xm.collective_permute(value, pairs) or torch.distributed.send/recv on the 'xla' process group"
    )


def recv(output: torch.Tensor, channel_id: int) -> torch.Tensor:
    """Refused: XLA's Recv with channel ids is not simulated."""
    raise NotImplementedError(
        "xm.recv (accel simulator): XLA Send/Recv with channel ids is not simulated; use "
        "xm.collective_permute(value, pairs) or torch.distributed.send/recv on the 'xla' process group"
    )


def xla_rendezvous(payload: bytes = b"", ordinals: list[int] | None = None, tag: str | None = None) -> list[bytes]:
    """Share `payload` with every replica (through XLA collectives, as torch_xla); `tag` is only logged."""
    if ordinals and len(ordinals) != runtime.global_device_count():
        raise ValueError("Only global rendezvous is supported")
    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    torch_xla.sync()
    device = torch_xla.device()
    data = torch.tensor(list(payload), dtype=torch.uint8)
    size = torch.tensor([data.shape[0]], dtype=torch.int, device=device)
    if tag:
        logging.info(f"Joining rendezvous '{tag}'...")
    sizes = all_gather(size)
    max_size = int(torch.max(sizes).item())
    torch_xla.sync()
    if max_size < 1:
        return [b"" for _ in range(sizes.size()[0])]
    padded = F.pad(data, (0, max_size - int(size.item()))).to(device)
    raw = all_gather(padded)
    payloads = [part[:n] for part, n in zip(torch.split(raw, max_size), sizes.cpu().tolist(), strict=True)]
    torch_xla.sync()
    return [bytes(p.cpu().tolist()) for p in payloads]


def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
    """Wait for every replica to reach a rendezvous; return each replica's `payload`, in ordinal order.

    As torch_xla's (an alias of `xla_rendezvous` under PJRT), the tag only names it in logs:
    replicas meet at their next rendezvous whatever its tag.
    """
    return xla_rendezvous(payload, replicas or None, tag=tag)


def do_on_ordinals(target: Callable[..., Any], data: Any = (), ordinals: Any = (0,)) -> Any:
    """Run `target(*data)` (with the data's tensors on the CPU) on `ordinals` only, then a rendezvous."""
    running = runtime.global_ordinal() in ordinals
    cpu_data = _maybe_convert_to_cpu(data, convert=running)
    result = target(*cpu_data) if running else None
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")
    return result


def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list[Any]], Any]) -> Any:
    """`reduce_fn` of the list of every replica's `data` (tensors moved to the CPU), out of the graph."""
    cpu_data = _maybe_convert_to_cpu(data)
    buffer = io.BytesIO()
    torch.save(cpu_data, buffer)
    gathered = rendezvous(tag, buffer.getvalue())
    loaded = [torch.load(io.BytesIO(item), weights_only=False) for item in gathered]
    return reduce_fn(loaded) if loaded else cpu_data


# -- training -------------------------------------------------------------------------------


def _fetch_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    gradients = []
    for param_group in optimizer.__getstate__()["param_groups"]:
        for group, params in param_group.items():
            if group == "params":
                for p in params:
                    if isinstance(p, torch.Tensor) and p.grad is not None:
                        gradients.append(p.grad.data)
    return gradients


def reduce_gradients(
    optimizer: torch.optim.Optimizer, groups: list[list[int]] | None = None, pin_layout: bool = True
) -> None:
    """Average the gradients of `optimizer`'s parameters over the replicas (in place)."""
    count = runtime.world_size()
    if count > 1:
        all_reduce(REDUCE_SUM, _fetch_gradients(optimizer), scale=1.0 / count, groups=groups, pin_layout=pin_layout)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict | None = None,
    groups: list[list[int]] | None = None,
    pin_layout: bool = True,
) -> Any:
    """Average the gradients over the replicas, then `optimizer.step(**optimizer_args)`; its result."""
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        torch_xla.sync()
    return loss


def add_step_closure(closure: Callable[..., Any], args: tuple = (), run_async: bool = False) -> None:
    """Run `closure(*args)` at the end of the step (the next `torch_xla.sync()`), in the order queued.

    `run_async=True` closures run there too, in this thread (the simulator has no asynchrony).
    """
    _state.step_closures.append(lambda a=args: closure(*a))


def _run_step_closures() -> None:
    closures = list(_state.step_closures)
    _state.step_closures.clear()
    for closure in closures:
        closure()


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Deprecated in torch_xla (use `torch_xla.sync()`): end the step."""
    _deprecated("Use torch_xla.sync instead")
    torch_xla.sync(wait, reset_scope)


def wait_device_ops(devices: list[str] | None = None) -> None:
    """Wait for the devices' pending work: none, the simulator runs eagerly."""


def _is_device_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and bridge.is_xla_tensor(value) and value.device.type != "cpu"


def _maybe_convert_to_cpu(data: Any, convert: bool = True) -> Any:
    """`data` with its XLA tensors moved to the CPU (lists for tuples, as torch_xla's walker gives)."""

    def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if convert else tensor

    return xu.for_each_instance_rewrite(data, _is_device_tensor, to_cpu)


def send_cpu_data_to_device(datas: Any, device: Any, input_sharding: Any = None) -> Any:
    """`datas` with its CPU tensors moved to `device` (a tensor gives a one-element list, as torch_xla's)."""
    if input_sharding is not None:
        raise NotImplementedError(
            "xm.send_cpu_data_to_device(input_sharding=...) (accel simulator): SPMD sharding is not simulated"
        )
    target = torch.device(device)

    def select(value: Any) -> bool:
        return type(value) is torch.Tensor and value.device.type == "cpu" and not bridge.is_xla_tensor(value)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        return bridge.from_host(tensor, target)

    if type(datas) is torch.Tensor:
        datas = [datas]
    return xu.for_each_instance_rewrite(datas, select, move)


def save(data: Any, file_or_path: Any, master_only: bool = True, global_master: bool = False) -> None:
    """`torch.save` of `data` moved to the CPU, by the master replica only (unless `master_only=False`).

    As torch_xla's, nothing waits for the write: `xm.rendezvous(...)` after it before others read the file.
    """
    should_write = not master_only or is_master_ordinal(local=not global_master)
    cpu_data = _maybe_convert_to_cpu(data, convert=should_write)
    if should_write:
        torch.save(cpu_data, file_or_path)


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Give every replica the master replica's parameters and buffers."""
    collective_broadcast([*model.parameters(), *model.buffers()])
    torch_xla.sync()


def get_memory_info(device: Any = None) -> Any:
    """Refused: the simulated TPU has no memory model."""
    raise NotImplementedError(
        "xm.get_memory_info (accel simulator): the simulated TPU counts no device memory "
        "(simulated GPUs do: accel launch --simulate cuda)"
    )


def get_stablehlo(tensors: list[torch.Tensor] | None = None) -> str:
    """Refused: the simulator builds no XLA graph."""
    raise NotImplementedError("xm.get_stablehlo (accel simulator): no XLA graph is built, the simulator runs eagerly")


# -- random numbers ---------------------------------------------------------------------------


def set_rng_state(seed: int, device: Any = None) -> None:
    """Seed the XLA generator (an integer state, as torch_xla's): what the device's next random op draws from."""
    _state.rng_seed = int(seed)
    device_seed = getattr(bridge, "set_rng_state", None)  # the device's own generator, where it has one
    if device_seed is not None:
        device_seed(int(seed), device)


def get_rng_state(device: Any = None) -> int:
    """The XLA generator's running state (XLA moves it on after each random op)."""
    device_seed = getattr(bridge, "get_rng_state", None)
    return int(device_seed(device)) if device_seed is not None else _state.rng_seed


@contextlib.contextmanager
def fork_rng(device: Any = None, enabled: bool = True) -> Iterator[None]:
    """Restore the XLA generator's state on exit."""
    if not enabled:
        yield
        return
    state = get_rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)
