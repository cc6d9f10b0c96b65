"""The "xla" process group and the `xla://` init method of the simulator, carried by Gloo.

Importing this module registers both, as importing torch_xla's does, so that
`torch.distributed.init_process_group("xla", init_method="xla://")` works in a simulated
TPU rank and `dist.get_backend()` answers "xla". A `ProcessGroupXla` is a Python process
group, as torch_xla's is, with torch_xla's behaviour: it takes XLA tensors only ("Expected
XLA tensor. Got: CPUFloatType"), refuses `ReduceOp.AVG` / `BXOR` / `PREMUL_SUM` as
torch_xla does, `all_to_all_single` without split sizes only, and its `barrier` waits for
nothing. Every collective hands the tensors' host copies (`accel.sim.xla.bridge.to_host`,
which share their storage) to a `ProcessGroupGloo` of its own and writes results in place
(the group's Gloo, the carrying on host tensors, torch's older names of the collectives and
the coalesced ones: `accel.sim.core.carried`).

`xm`'s collectives run over these groups too (`replica_group`, `sub_group`), through the
public `torch.distributed` functions, so that the simulator's collective check and
deadlock detection see them as they see any collective.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, AllToAllOptions

# The module, not the function `torch.distributed.rendezvous` that shadows its name.
_rendezvous = importlib.import_module("torch.distributed.rendezvous")

import torch_xla._sim_state as _state  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from accel.sim.core import carried, device_rules  # noqa: E402
from accel.sim.diagnoses import collectives  # noqa: E402
from accel.sim.xla import bridge  # noqa: E402

BACKEND_NAME = "xla"

_logger = logging.getLogger(__name__)


def type_string(tensor: torch.Tensor) -> str:
    """ATen's name of `tensor`'s type, as torch_xla's errors print it ("CPUFloatType")."""
    scalar = device_rules.SCALAR_NAMES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch.").capitalize())
    return f"{tensor.device.type.upper()}{scalar}Type"


def check_xla(tensors: Sequence[torch.Tensor]) -> None:
    """torch_xla's refusal of a non-XLA tensor where its collectives expect XLA tensors."""
    for index, tensor in enumerate(tensors):
        if not bridge.is_xla_tensor(tensor):
            if len(tensors) == 1:
                raise RuntimeError(f"Expected XLA tensor. Got: {type_string(tensor)}")
            raise RuntimeError(
                "Expected all tensors in the given list to be XLA tensors. Element at index "
                f"{index} is not an XLA tensor. Got: {type_string(tensor)}"
            )


# As torch_xla's ProcessGroupXla: a work object already completed, holding the result.
_work = carried.completed_work


def _reduce_op(op: Any) -> Any:
    """`op` if Gloo and torch_xla both reduce with it; torch_xla's errors otherwise."""
    kind = getattr(op, "op", op)  # PREMUL_SUM is an op object
    allowed = (
        dist.ReduceOp.SUM,
        dist.ReduceOp.PRODUCT,
        dist.ReduceOp.BAND,
        dist.ReduceOp.BOR,
        dist.ReduceOp.MIN,
        dist.ReduceOp.MAX,
    )
    if kind in allowed:
        return kind
    if kind == dist.ReduceOp.BXOR:
        raise NotImplementedError(f"reduce op {op}")
    raise ValueError(f"Invalid reduce op {op}")


_P2P_WARNING = (
    "Individual send/recv ops are inefficient on an XLA device. Consider using "
    "xla_model.collective_permute() and specifying all source-target pairs."
)


class ProcessGroupXla(carried.CarriedGroup):
    """torch_xla's "xla" process group, carried by a Gloo group of its own (module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(store, rank, size, timeout)
        self.prefix_store = store
        self.timeout = timeout

    def getBackendName(self) -> str:  # torch's name
        return BACKEND_NAME

    def _allreduce(self, host: torch.Tensor, op: Any) -> torch.Tensor:
        """`host` (contiguous) reduced over the group with `op`, in place (reduce and reduce_scatter too: a copy)."""
        opts = AllreduceOptions()
        opts.reduceOp = op
        self._gloo.allreduce([host], opts).wait()
        return host

    def _reduced_copy(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        """A host copy of `tensor`, reduced over the group (the input untouched)."""
        return self._allreduce(bridge.to_host(tensor).clone(memory_format=torch.contiguous_format), op)

    # -- collectives ------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        check_xla(tensors)
        for tensor in tensors:
            with carried.contiguous(bridge.to_host(tensor)) as host:
                self._allreduce(host, op)
        return _work(tensors)

    def allreduce_coalesced(self, *args: Any) -> Any:
        raise NotImplementedError

    def all_gather_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None) -> Any:
        check_xla([output_tensor, input_tensor])
        if input_tensor.dim() == 0:
            input_tensor = input_tensor.reshape(1)
        result = torch.cat(self._gathered(bridge.to_host(input_tensor)), dim=0)
        out = bridge.to_host(output_tensor)
        if result.shape == output_tensor.shape:
            out.copy_(result)
            return _work([output_tensor])
        stacked = torch.stack(torch.split(result, input_tensor.shape[0], dim=0), dim=0)
        if stacked.shape == output_tensor.shape:
            out.copy_(stacked)
            return _work([output_tensor])
        raise ValueError(
            f"Input shape {input_tensor.shape} and output shape {output_tensor.shape} are not compatible for "
            "all_gather_into_tensor. Input must be stacked or concatenated to create output."
        )

    def allgather(self, output_tensors_list: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts=None):
        for input_tensor, output_tensors in zip(input_tensors, output_tensors_list, strict=True):
            check_xla([input_tensor, *output_tensors])
            for output, part in zip(output_tensors, self._gathered(bridge.to_host(input_tensor)), strict=True):
                bridge.to_host(output).copy_(part.reshape(output.shape))
        return _work([t for outputs in output_tensors_list for t in outputs])

    def allgather_coalesced(self, output_tensors_list, input_tensors, opts=None):
        return self.allgather(output_tensors_list, input_tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        root = tensors[opts.rootTensor]
        check_xla([root])
        self._broadcast(bridge.to_host(root), opts.rootRank)
        return _work([root])

    def _reduce_scatter_one(self, output: torch.Tensor, flat_input: torch.Tensor, op: Any) -> None:
        reduced = self._reduced_copy(flat_input, op)
        mine = torch.chunk(reduced, self.size(), dim=0)[self.rank()]
        bridge.to_host(output).copy_(mine.reshape(output.shape))

    def reduce_scatter(self, output_tensors, input_tensors_list, opts):
        op = _reduce_op(opts.reduceOp)
        for input_tensors, output_tensor in zip(input_tensors_list, output_tensors, strict=True):
            first_shape = input_tensors[0].shape
            for i, t in enumerate(input_tensors[1:]):
                if first_shape != t.shape:
                    raise ValueError(f"Input {i + 1}'s shape is different from input 0: {t.shape} vs {first_shape}")
            check_xla([output_tensor, *input_tensors])
            self._reduce_scatter_one(output_tensor, torch.cat(input_tensors), op)
        return _work(output_tensors)

    def reduce_scatter_coalesced(self, output_tensors, input_tensors_list, opts):
        return self.reduce_scatter(output_tensors, input_tensors_list, opts)

    def reduce_scatter_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any) -> Any:
        op = _reduce_op(opts.reduceOp)
        check_xla([output_tensor, input_tensor])
        if input_tensor.numel() != output_tensor.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor: the input has {input_tensor.numel()} elements, not the output's "
                f"{output_tensor.numel()} times the group's {self.size()} members"
            )
        self._reduce_scatter_one(output_tensor, input_tensor.reshape(-1), op)
        return _work(output_tensor)

    def barrier(self, opts: Any = None) -> Any:
        # torch_xla's barrier returns at once: XLA orders collectives by the graphs they are in.
        return _work([])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        op = _reduce_op(opts.reduceOp)
        check_xla(tensors)
        for tensor in tensors:
            reduced = self._reduced_copy(tensor, op)
            if self.rank() == opts.rootRank:
                bridge.to_host(tensor).copy_(reduced)
        return _work(tensors)

    def alltoall(self, output_tensor_list, input_tensor_list, opts=None):
        check_xla([*output_tensor_list, *input_tensor_list])
        stacked = torch.stack([bridge.to_host(t) for t in input_tensor_list], dim=0).contiguous()
        received = torch.empty_like(stacked)
        self._gloo.alltoall_base(received, stacked, [], [], AllToAllOptions()).wait()
        for part, output in zip(received, output_tensor_list, strict=True):
            bridge.to_host(output).copy_(part)
        return _work(output_tensor_list)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        assert (not output_split_sizes) and (not input_split_sizes), (
            "XLA doesn't support specifying non-empty output_split_sizes and input_split_sizes"
        )
        check_xla([output, input])
        with carried.contiguous(bridge.to_host(output)) as received:
            self._gloo.alltoall_base(received, bridge.to_host(input).contiguous(), [], [], AllToAllOptions()).wait()
        return _work(output)

    def gather(self, output_tensors_list, input_tensor_list, opts):
        for i, input_tensor in enumerate(input_tensor_list):
            check_xla([input_tensor])
            parts = self._gathered(bridge.to_host(input_tensor))
            if self.rank() == opts.rootRank:
                for output, part in zip(output_tensors_list[i], parts, strict=True):
                    bridge.to_host(output).copy_(part.reshape(output.shape))
        return _work(output_tensors_list if self.rank() == opts.rootRank else [[]])

    def scatter(self, output_tensor_list, input_tensors_list, opts):
        for i, output in enumerate(output_tensor_list):
            check_xla([output])
            if self.rank() == opts.rootRank:
                source = torch.stack([bridge.to_host(t) for t in input_tensors_list[i]]).contiguous()
            else:
                source = torch.empty((self.size(), *output.shape), dtype=output.dtype)
            self._broadcast(source, opts.rootRank)
            bridge.to_host(output).copy_(source[self.rank()])
        return _work(output_tensor_list)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Any:
        _logger.warning(_P2P_WARNING)
        check_xla(tensors)
        for tensor in tensors:
            self._gloo.send([bridge.to_host(tensor).contiguous()], dst_rank, tag).wait()
        return _work(tensors)

    def recv(self, out_tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Any:
        _logger.warning(_P2P_WARNING)
        check_xla(out_tensors)
        for tensor in out_tensors:
            with carried.contiguous(bridge.to_host(tensor)) as host:
                self._gloo.recv([host], src_rank, tag).wait()
        return _work(out_tensors)

    def recv_anysource(self, *args: Any) -> Any:
        raise NotImplementedError

    def monitored_barrier(self, *args: Any) -> Any:
        raise NotImplementedError


def _create_xla_process_group(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupXla:
    return ProcessGroupXla(store, rank, size, timeout)


def _xla_rendezvous_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Iterator[Any]:
    # Ranks come from the runtime (the launcher's environment); the store from
    # MASTER_ADDR/MASTER_PORT, exactly as env:// does.
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    rank = int(query.get("rank", xr.global_ordinal()))
    world_size = int(query.get("world_size", xr.world_size()))
    yield from _rendezvous.rendezvous("env://", rank, world_size, timeout=timeout)


# -- the groups xm's collectives run on ----------------------------------------------------


def replica_group(op: str = "new_group") -> ProcessGroupXla:
    """The "xla" group of every replica: the default group when it is one, else one made for xm (once).

    Making it is a step of the xm collective `op` that every replica must reach (see `sub_group`).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch_xla (accel simulator): this rank has no process group to carry XLA collectives (the "
            "simulator makes one in each rank; was it destroyed?); call "
            "torch.distributed.init_process_group('xla', init_method='xla://') first"
        )
    default = dist.distributed_c10d._get_default_group()
    if isinstance(default, ProcessGroupXla):
        return default
    cached = _state.replica_group
    if cached is None or cached[0] is not default:
        # The script made a default group of another backend: XLA's collectives still span every replica.
        made = collectives.joint_step(
            f"{op} with a new group of all replicas",
            None,
            f"{op} with a new {BACKEND_NAME!r} group of all replicas",
            lambda: dist.new_group(backend=BACKEND_NAME),
        )
        _state.replica_group = cached = (default, made)
    group: ProcessGroupXla = cached[1]
    return group


def sub_group(groups: Sequence[Sequence[int]], op: str = "new_group") -> ProcessGroupXla:
    """This replica's group among the replica groups `groups` (which must split all replicas evenly).

    The first xm collective `op` with these groups makes them, with every replica (torch's
    rule for `dist.new_group`; on a TPU every replica runs a collective with replica
    groups): that goes through the collective check as a step of `op` on the group of all
    replicas, so replicas that do not all reach it are reported (a deadlock, or a
    mismatch naming what the others called) instead of waiting in the new groups'
    rendezvous until the store's timeout.
    """
    world = xr.world_size()
    key = tuple(tuple(int(r) for r in g) for g in groups)
    members = sorted(r for g in key for r in g)
    if members != list(range(world)):
        raise ValueError(f"replica groups {[list(g) for g in key]} must name each of the {world} replicas exactly once")
    base = replica_group(op)
    cached = _state.sub_groups.get(key)
    if cached is not None and cached[0] is base:
        return cached[1]
    me = xr.global_ordinal()

    def make() -> ProcessGroupXla:
        mine = None
        for ranks in key:  # every replica creates every group, in the same order (torch's rule)
            group = dist.new_group(ranks=list(ranks), backend=BACKEND_NAME)
            if me in ranks:
                mine = group
        assert mine is not None  # every replica is in one of the groups (checked above)
        return mine

    listed = [list(g) for g in key]
    mine = collectives.joint_step(f"{op} with new replica groups", base, f"{op} with new replica groups {listed}", make)
    _state.sub_groups[key] = (base, mine)
    return mine


def _register() -> None:
    # Registration is process-wide and torch refuses a second one; importing twice is fine.
    if BACKEND_NAME not in dist.Backend.backend_list:
        # The device type of this rank's XLA device ("xla", as torch_xla registers it).
        dist.Backend.register_backend(BACKEND_NAME, _create_xla_process_group, devices=[bridge.xla_device().type])
    if BACKEND_NAME not in _rendezvous._rendezvous_handlers:
        _rendezvous.register_rendezvous_handler(BACKEND_NAME, _xla_rendezvous_handler)


_register()
