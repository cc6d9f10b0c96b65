"""What the clock hears: each op on a simulated GPU, the host's waits, collectives, optimizer steps.

The core calls `time_op` after every op on simulated CUDA tensors while `running` is non-empty (the
device's `timing` list); the "nccl" group calls `collective`; `sync_debug` calls `host_waits_for_gpu`
where a GPU host waits; torch's optimizer hook ends the steps.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.tensors.cuda_tensor import is_simulated_cuda
from accel.sim.cuda.timing import clock as clocks
from accel.sim.cuda.timing import collectives, costs, fusion, modules
from accel.sim.cuda.timing.trace import TRACE_ENV
from accel.sim.cuda.timing.units import parse_network

aten = torch.ops.aten

#: non-empty while the clock runs (the list holding it): the core tests its truth on every op
running = clocks._clock
#: ``ACCEL_SIM_NETWORK``: each GPU's NIC between nodes, e.g. "400Gbps" (default: the card's usual one)
NETWORK_ENV = "ACCEL_SIM_NETWORK"
#: ``ACCEL_SIM_GPUS_PER_NODE``: GPUs a node holds (NVLink within it), default 8
GPUS_PER_NODE_ENV = "ACCEL_SIM_GPUS_PER_NODE"

_kinds: dict[Any, str | None] = {}
_names: dict[Any, str] = {}
_UNSEEN = "unseen"
_COPIES = {aten._to_copy.default, aten.copy_.default}


def stream_of(index: int) -> int:
    """The id of GPU `index`'s current stream (0: its default stream)."""
    stream = cuda_state.gpus().streams.get(index)
    return 0 if stream is None else stream.sim_id


def time_op(index: int, func: Any, args: Any, kwargs: dict, out: Any) -> None:
    """Op `func` ran on simulated GPU `index` with these arguments and result: put its kernel on the clock."""
    clock = running[0]
    kind = _kinds.get(func, _UNSEEN)
    if kind == _UNSEEN:
        kind = _kinds[func] = costs.kind_of(func)
        _names[func] = func.name().split("::")[-1]
    if kind is None:
        clock.issue_only()
        return
    if fusion.regions:
        between = func in _COPIES and _between_host_and_gpu(func, args, out)
        if kind == "memory" and not between and fusion.inside():
            fusion.add(clock, index, stream_of(index), args, out)
            return
        fusion.flush(clock, args)  # a kernel Inductor does not generate ends the fused one before it
    if func in _COPIES and _between_host_and_gpu(func, args, out):
        source = args[0] if func is aten._to_copy.default else args[1]
        way = "HtoD" if is_simulated_cuda(args[0] if func is aten.copy_.default else out) else "DtoH"
        end = clock.launch(
            index, stream_of(index), costs.transfer(clock.card, costs.nbytes(source)), name=f"memcpy {way}"
        )
        if not (kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
            clock.host_waits(end)  # a blocking copy: the host waits for it
        return
    seconds, flops = costs.duration(clock.card, func, kind, args, kwargs, out)
    clock.launch(index, stream_of(index), seconds, flops, name=_names[func])


def fused_kernel(index: int, nbytes: int) -> None:
    """A kernel Inductor generates for a compiled region ran on GPU `index`, moving `nbytes` at its boundary."""
    if running:
        clock = running[0]
        clock.launch(index, stream_of(index), costs.moved(clock.card, nbytes), name="fused kernel (compiled)")


def name_kernels() -> None:
    """The clock just started: where a trace is asked for, its kernels are named by module (`modules`)."""
    if running:
        running[0].namer = modules.where if os.environ.get(TRACE_ENV) else None


def op_by_op_region(forward: Any) -> Any:
    """A compiled region that runs op by op here: timed as Inductor's fused kernels (`fusion`)."""
    if not fusion.regions:
        fusion.regions.append(True)
    return fusion.region(forward, clocks.current)


def _settle() -> None:
    """The host waits or a collective starts: a fused kernel still gathering is launched first."""
    if fusion.pending:
        fusion.flush(running[0])


def _between_host_and_gpu(func: Any, args: Any, out: Any) -> bool:
    target = out if func is aten._to_copy.default else args[0]
    source = args[0] if func is aten._to_copy.default else args[1]
    return is_simulated_cuda(target) != is_simulated_cuda(source)


def host_waits_for_gpu() -> None:
    """The host waits for the current GPU's current stream (`.item()`, `Stream.synchronize`, data-sized ops)."""
    if running:
        _settle()
        clock = running[0]
        index = cuda_state.gpus().current
        clock.host_waits(clock.ready(index, stream_of(index)))


def synchronize(index: int | None) -> None:
    """`torch.cuda.synchronize(index)`: the host waits for every stream of that GPU."""
    if running:
        _settle()
        clock = running[0]
        clock.host_waits(clock.drained(index))


def links() -> collectives.Links:
    """The links between GPUs: the card's NVLink (else PCIe) within a node, the network between nodes."""
    speeds = running[0].card.speeds
    intra = speeds.nvlink_gbps * collectives.NVLINK_USABLE if speeds.nvlink_gbps else speeds.pcie_gbps * 0.8
    network = os.environ.get(NETWORK_ENV)
    nic_gbits = parse_network(network) if network else speeds.network_gbits
    per_node = int(os.environ.get(GPUS_PER_NODE_ENV, "8"))
    return collectives.Links(intra_gbps=intra, nic_gbps=nic_gbits / 8, gpus_per_node=per_node)


def collective(name: str, nbytes: int, ranks: list[int] | int, group_key: Any, index: int) -> float | None:
    """A collective issued from GPU `index`'s current stream to its group's NCCL stream; returns when it ends
    (None when the clock is off). `ranks`: the group's global ranks (or its size, ranks taken as consecutive)."""
    if not running:
        return None
    _settle()
    clock = running[0]
    stream = stream_of(index)
    channel = ("nccl", group_key)
    clock.wait(index, channel, clock.ready(index, stream))  # NCCL's stream waits for what was queued before
    size, placed = _placement(ranks, links())
    seconds = collectives.seconds(name, nbytes, size, placed)
    start, link = clock.ready(index, channel), collectives.bottleneck(size, placed)
    seconds += _sharing(clock, index, channel, link, start, start + seconds)
    end = clock.launch(index, channel, seconds, comm=True, name=f"nccl {name}")
    busy = clock.collectives.setdefault(index, [])
    busy.append((start, end, link, channel))
    del busy[:-_BUSY_KEPT]
    return end


#: how many of a GPU's latest collectives are kept to see which the next one overlaps
_BUSY_KEPT = 32


def _sharing(clock: clocks.Clock, index: int, channel: Any, link: str, start: float, end: float) -> float:
    """How much longer a collective over (`start`, `end`) takes for sharing its link with the collectives of
    other groups running then on GPU `index`: those keep their times (they were issued first), so it runs
    in the time they leave it, as long again as they overlap it."""
    total = 0.0
    for other_start, other_end, other_link, other_channel in clock.collectives.get(index, ()):
        if other_link == link and other_channel != channel:
            total += max(0.0, min(end, other_end) - max(start, other_start))
    return total


def _placement(ranks: list[int] | int, links: collectives.Links) -> tuple[int, collectives.Links]:
    """(group size, links as the group sees them): its ranks per node decide which links it crosses."""
    if isinstance(ranks, int):
        return ranks, links
    nodes: dict[int, int] = {}
    for rank in ranks:
        nodes[rank // links.gpus_per_node] = nodes.get(rank // links.gpus_per_node, 0) + 1
    per_node = max(nodes.values(), default=1)
    return len(ranks), collectives.Links(links.intra_gbps, links.nic_gbps, per_node)


def stream_waits_for(index: int, end: float | None) -> None:
    """A collective's work is waited on: GPU `index`'s current stream runs nothing more before `end`."""
    if running and end is not None:
        running[0].wait(index, stream_of(index), end)


def optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's hook after every `Optimizer.step()`: the clock's steps end there."""
    if running:
        _settle()
        running[0].optimizer_stepped(optimizer)


_hooked: list[Any] = []


def install() -> None:
    """Once per process: hear every optimizer's steps (`torch.optim.optimizer.register_optimizer_step_post_hook`)."""
    if not _hooked:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hooked.append(register_optimizer_step_post_hook(optimizer_stepped))
