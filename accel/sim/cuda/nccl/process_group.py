"""The "nccl" process group of a simulated GPU rank: NCCL's rules, carried by Gloo.

A CPU-only torch has no NCCL, so in a simulated GPU rank `init_process_group("nccl")`
creates a `SimNcclGroup`: a Python process-group backend that takes simulated CUDA
tensors, hands their inner CPU tensors to a `ProcessGroupGloo`, and gives the caller's
CUDA tensors back. It computes what ProcessGroupNCCL (torch 2.13) computes where Gloo
alone would differ, and refuses what NCCL refuses, with NCCL's words:

* **buffers, not shapes**: NCCL sends a pointer and an element count, so
  `all_gather_into_tensor` takes an output of shape `(world * n,)` or `(world, n)` for an
  input of shape `(1, n)`, `reduce_scatter_tensor` likewise, and `all_gather` /
  `reduce_scatter` lists of unequal sizes work as NCCL's broadcast / reduce fallbacks do.
  Wrong element counts raise NCCL's errors ("output tensor size must be equal to
  world_size times input tensor size", ...).
* **reductions Gloo lacks**: `ReduceOp.AVG` and `PREMUL_SUM`
  (`torch.distributed._make_nccl_premul_sum(factor)`) are computed as NCCL computes them:
  floating-point inputs are multiplied by the factor (for AVG: 1/world, in the tensor's
  dtype) and then summed; integer AVG sums and then divides, rounding toward zero. A bool
  SUM is NCCL's MAX. BAND/BOR/BXOR, AVG of bools, PREMUL_SUM of integers, float8
  reductions and dtypes NCCL has no type for are refused with NCCL's errors.
* **coalesced collectives**: `_coalescing_manager` (with or without `device`, with or
  without `async_ops`) over `all_reduce`, `all_gather_into_tensor`,
  `reduce_scatter_tensor` and point-to-point ops; `all_reduce_coalesced`.
  `all_gather_coalesced` raises NCCL's NotImplementedError.
* **all-to-all**: `all_to_all_single` with uneven split sizes, `all_to_all` lists.
* **point-to-point**: `isend` / `irecv` return work under way (as NCCL's do), so a
  `batch_isend_irecv` ring does not lock; each pair of ranks sets up its own
  communicator at its first exchange and involves no other rank.
* **work objects** of `async_op=True` calls: `wait()`, `is_completed()`, `get_future()`
  whose value is NCCL's (the output tensors).
* **eager init and subgroups**: `init_process_group(device_id=...)` sets the group's
  `bound_device_id` and its communicator at once; `new_group(..., backend="nccl")` and
  `torch.distributed.split_group(...)` create simulated NCCL subgroups (split_group needs
  a bound device, as with NCCL).
* **devices**: a CPU tensor as the tensor a collective runs on: torch's "No backend type
  associated with device type cpu"; a CPU tensor among CUDA ones: "Tensors must be CUDA
  and dense" (a ValueError, as ProcessGroupNCCL raises it); two ranks of the group on the
  same GPU (a forgotten `torch.cuda.set_device(local_rank)`): NCCL's "Duplicate GPU
  detected" when the communicator is set up, on every rank.

Collectives (point-to-point transfers aside) finish before they return (the simulator has
no asynchrony, see docs/simulated-gpus.md): their work objects are already completed. Numerics are Gloo's
summation order on the CPU, not NCCL's ring on a GPU.

The torch name of this backend is `BACKEND` ("sim_nccl": torch's "nccl" branch wants the
real library); `install()` makes the rest of `torch.distributed` speak of it as "nccl":
`get_backend()` says "nccl" (`accel.sim.runtime.adopt_group`), `is_nccl_available()` is true, and `"nccl"` given to
`new_group` (or to `init_process_group`, see `accel.sim.runtime.adopt_group`) means this group.
Installed only in simulated GPU ranks.
"""

from __future__ import annotations

import datetime
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from accel.sim.core import torch_internals
from accel.sim.core.carried import CarriedGroup, given
from accel.sim.core.carried import PythonGroup as PythonGroup  # its former home
from accel.sim.cuda.gpus import shapes as cuda_shapes
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.memory import report as memory_report
from accel.sim.cuda.nccl.timed import first, second, timed
from accel.sim.cuda.tensors.cuda_tensor import is_simulated_cuda, unwrap

#: the name torch knows this backend by
BACKEND = "sim_nccl"
#: the backend torch is given for "cpu:gloo,cuda:nccl" (`accel.sim.cuda.nccl.mixed_group` registers it)
MIXED_BACKEND = "accel_sim_cuda"
#: the name user code knows it by
NCCL = "nccl"

#: what `torch.cuda.nccl.version()` says in a simulated GPU rank (torch's logging of a failed
#: collective on a "nccl" group asks for it)
NCCL_VERSION = (2, 21, 5)

#: Gloo tag of the messages that set up a point-to-point communicator (apart from the user's)
PAIR_TAG = 0x5EC0

# ProcessGroupNCCL's words (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, torch 2.13)
NOT_CUDA = "Tensors must be CUDA and dense"
NOT_CONTIGUOUS = "Tensors must be contiguous"
MULTI_DEVICE = "Expecting one tensor only but got multiple"
P2P_NOT_CONTIGUOUS = (
    "Detected non-contiguous tensor in P2P operations. It is user responsibility to guarantee that source and "
    "destination tensors have the same contiguity format."
)
FLOAT8_REDUCTION = "Unsupported Float8 type for NCCL reduction"

_RedOp: Any = dist.ReduceOp.RedOpType  # its stubs declare no members
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: float8 dtypes this torch has; NCCL before 2.24 (the simulated one is 2.21) reduces none of them
_FLOAT8 = tuple(
    getattr(torch, name)
    for name in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
#: dtypes NCCL has a type for (ncclDataType in torch's NCCLUtils.hpp)
_NCCL_DTYPES = {
    torch.int8,
    torch.uint8,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bool,
    torch.bfloat16,
    *(t for t in _FLOAT8 if str(t) != "torch.float8_e8m0fnu"),
}
#: C++ names (c10::ScalarType) of dtypes NCCL lacks, as its error prints them
_SCALAR_TYPE_NAMES = {
    torch.int16: "Short",
    torch.uint16: "UInt16",
    torch.uint32: "UInt32",
    torch.uint64: "UInt64",
    torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}

memory_report.collective_source(__file__)  # the buffers this module's code makes are collective buffers


def duplicate_gpu_error(rank: int, other: int, index: int) -> dist.DistBackendError:
    """What NCCL raises when two ranks of one communicator use the same GPU."""
    return dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp, invalid usage (run with NCCL_DEBUG=WARN for details), "
        "NCCL version (simulated)\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "Last error:\n"
        f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device {index}\n"
        f"(accel.sim: ranks {other} and {rank} both ran their first collective on the host's simulated GPU {index}; "
        "on a real node each process must call torch.cuda.set_device(local_rank) before it communicates, or see "
        "only its own GPU through CUDA_VISIBLE_DEVICES)"
    )


def _flatten(items: Any) -> list[torch.Tensor]:
    if isinstance(items, torch.Tensor):
        return [items]
    return [t for item in items for t in _flatten(item)]


def _unwrapped(items: Any) -> Any:
    """The same nesting of lists, with each simulated CUDA tensor replaced by its inner CPU tensor."""
    if isinstance(items, torch.Tensor):
        return unwrap(items)
    return type(items)(_unwrapped(item) for item in items)


# -- NCCL's checks on tensors ----------------------------------------------------------------------


def _dense_in_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill one block of memory (any order of dimensions)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _contiguous(tensor: torch.Tensor) -> bool:
    # NCCL's `is_contiguous(suggest_memory_format())`: contiguous, or channels-last for 4-D/5-D tensors
    if tensor.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return tensor.dim() in formats and tensor.is_contiguous(memory_format=formats[tensor.dim()])


def _check_tensor(tensor: torch.Tensor, p2p: bool = False) -> None:
    """ProcessGroupNCCL's `check_gpu_single_tensor`: CUDA, dense, contiguous (p2p: a warning)."""
    if not is_simulated_cuda(tensor) or tensor.is_sparse:
        raise ValueError(NOT_CUDA)
    if not _contiguous(tensor):
        if not p2p:
            raise ValueError(NOT_CONTIGUOUS)
        warnings.warn(P2P_NOT_CONTIGUOUS, stacklevel=4)
        if not _dense_in_memory(tensor):
            raise ValueError(
                "accel.sim: this point-to-point tensor is a strided view with gaps; NCCL would send "
                f"{tensor.numel()} elements from its first address, i.e. other memory than the view's (undefined "
                "behaviour). Send a contiguous tensor (.contiguous())."
            )


def _check_same_device(tensors: list[torch.Tensor]) -> None:
    """ProcessGroupNCCL's `check_gpu_tensors_same_device` (the coalesced collectives' check)."""
    if not tensors:
        raise ValueError("Tensor list must be nonempty")
    for tensor in tensors:
        if not is_simulated_cuda(tensor) or tensor.is_sparse:
            raise ValueError(NOT_CUDA)
        if tensor.dtype != tensors[0].dtype:
            raise TypeError("Tensors must have identical type")
        if not _dense_in_memory(tensor):
            raise ValueError("Tensors must be non-overlapping and dense")
        if tensor.device != tensors[0].device:
            raise ValueError("Expected list of tensors on the same device")


def _check_dtype(tensor: torch.Tensor) -> None:
    """NCCL's `getNcclDataType`: refuses dtypes NCCL has no type for."""
    if tensor.dtype not in _NCCL_DTYPES:
        name = _SCALAR_TYPE_NAMES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
        raise TypeError(f"Input tensor data type is not supported for NCCL process group: {name}")


def _one(items: list[Any]) -> Any:
    """The single tensor (or tensor list) of a one-GPU call: ProcessGroupNCCL serves one GPU per process."""
    if len(items) != 1:
        raise RuntimeError(MULTI_DEVICE)
    return items[0]


def _movable(inner: torch.Tensor) -> torch.Tensor:
    """`inner` as Gloo can move it: float8 as bytes (NCCL moves them as uint8; Gloo has no float8 type)."""
    return inner.view(torch.uint8) if inner.dtype in _FLOAT8 else inner


def _check_counts(name: str, kind: str, parts: list[torch.Tensor], own: torch.Tensor, would: str) -> None:
    """Each of a list collective's `parts` must hold as many elements as this rank's own tensor."""
    other = "input" if kind == "output" else "output"
    for part in parts:
        if part.numel() != own.numel():
            raise ValueError(
                f"accel.sim: {name} {kind} tensors hold {part.numel()} elements each and the {other} {own.numel()}; "
                f"NCCL would {would} (undefined behaviour). Give {kind}s of the {other}'s size."
            )


def _flat(inner: torch.Tensor) -> torch.Tensor:
    """`inner`'s elements in memory order, as one 1-D view: what NCCL sends (an address and a count)."""
    flat = inner.view(-1) if inner.is_contiguous() else inner.as_strided((inner.numel(),), (1,))
    return _movable(flat)


# -- reductions: NCCL's, computed with Gloo's ---------------------------------------------------------


class _Reduction:
    """One NCCL reduction as Gloo runs it: Gloo's `op` on inputs multiplied by `scale`, then divided by `divisor`."""

    def __init__(
        self, op: Any, scale: torch.Tensor | None = None, divisor: int | None = None, callers: bool = False
    ) -> None:
        self.op = op
        self.scale = scale
        self.divisor = divisor
        #: Gloo runs the caller's own op: its options can go to Gloo as they are
        self.callers = callers

    def contribution(self, inner: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """What this rank hands Gloo: its data scaled (a new tensor), else `inner` itself (or a copy)."""
        if self.scale is not None:
            return inner * self.scale
        return inner.clone() if copy else inner

    def finish(self, inner: torch.Tensor) -> None:
        """The result in place: integer AVG divides the sum, rounding toward zero as NCCL does."""
        if self.divisor is not None:
            inner.div_(self.divisor, rounding_mode="trunc")

    def options(self, opts: Any, kind: Any) -> Any:
        """Options of type `kind` for Gloo, copied from `opts`, with Gloo's reduce op."""
        if self.callers and isinstance(opts, kind):
            return opts  # the common case (a SUM), without a copy
        new = kind()
        for field in ("rootRank", "rootTensor", "timeout", "asyncOp"):
            if opts is not None and hasattr(opts, field) and hasattr(new, field):
                setattr(new, field, getattr(opts, field))
        new.reduceOp = self.op
        return new


def _op_type(op: Any) -> Any:
    # a ReduceOp object (options hold one) or its RedOpType (what user code passes)
    return getattr(op, "op", op)


def _scalar(value: Any, dtype: torch.dtype) -> torch.Tensor:
    # NCCL multiplies in the tensor's dtype: the factor is first converted to it
    if isinstance(value, torch.Tensor):
        return unwrap(value).detach().reshape(()).to(dtype)
    return torch.tensor(value, dtype=torch.float64 if dtype == torch.float64 else torch.float32).to(dtype)


def reduction(op: Any, dtype: torch.dtype, size: int) -> _Reduction:
    """How NCCL reduces `dtype` with `op` in a group of `size` ranks, or NCCL's error for it."""
    op = dist.ReduceOp.SUM if op is None else op
    kind = _op_type(op)
    if kind in (_RedOp.BAND, _RedOp.BOR, _RedOp.BXOR):
        raise ValueError(f"Cannot use ReduceOp.{kind.name} with NCCL")
    if dtype == torch.bool:
        if kind == _RedOp.SUM:
            return _Reduction(dist.ReduceOp.MAX)  # NCCL: a bool sum is a logical or
        if kind == _RedOp.AVG:
            raise TypeError("Cannot use ReduceOp.AVG with boolean inputs")
    if kind == _RedOp.PREMUL_SUM:
        if dtype not in _FLOATS:
            raise TypeError("PreMulSum Data type must be half, float, bfloat16 or double")
        return _Reduction(dist.ReduceOp.SUM, scale=_scalar(op.factor, dtype))
    if kind == _RedOp.AVG:
        if dtype in _FLOATS:  # NCCL: a PreMulSum by 1/size for floating-point types
            return _Reduction(dist.ReduceOp.SUM, scale=_scalar(1.0 / size, dtype))
        return _Reduction(dist.ReduceOp.SUM, divisor=size)  # integers: sum, then divide
    if kind in (_RedOp.SUM, _RedOp.PRODUCT, _RedOp.MIN, _RedOp.MAX):
        return _Reduction(op, callers=True)
    raise ValueError("Unhandled ReduceOp")


def _reduction_for(opts: Any, tensor: torch.Tensor, size: int) -> _Reduction:
    """The reduction of `opts` for `tensor`'s dtype, after NCCL's dtype checks for reductions."""
    _check_dtype(tensor)
    if tensor.dtype in _FLOAT8:
        raise RuntimeError(FLOAT8_REDUCTION)
    return reduction(getattr(opts, "reduceOp", None), tensor.dtype, size)


# -- work objects ------------------------------------------------------------------------------------


class _PairSetup:
    """The communicator of two ranks (NCCL's for send/recv): each sends the other its GPU, without waiting.

    Posted when the pair first exchanges data and checked when a transfer is waited on, so
    that the ranks of a `batch_isend_irecv` ring can all post before any of them waits.
    """

    def __init__(self, gloo: Any, rank: int, peer: int, index: int) -> None:
        self.rank, self.peer, self.index = rank, peer, index
        self._mine = torch.tensor([index], dtype=torch.int64)
        self._theirs = torch.full((1,), -1, dtype=torch.int64)
        self._works = [gloo.send([self._mine], peer, PAIR_TAG), gloo.recv([self._theirs], peer, PAIR_TAG)]
        self._exchanged = False

    def finished(self) -> bool:
        return self._exchanged or all(work.is_completed() for work in self._works)

    def check(self) -> None:
        """Wait for the peer's GPU; NCCL's "Duplicate GPU detected" if it is this rank's."""
        if not self._exchanged:
            for work in self._works:
                work.wait()
            self._exchanged = True
        if int(self._theirs.item()) == self.index:
            raise duplicate_gpu_error(max(self.rank, self.peer), min(self.rank, self.peer), self.index)


class _TransferWork(dist.Work):
    """A send or recv under way on Gloo, returned unwaited (as NCCL's isend/irecv work is)."""

    def __init__(self, setup: _PairSetup, transfer: Any, tensor: torch.Tensor) -> None:
        super().__init__()
        self._setup, self._transfer, self._tensor = setup, transfer, tensor
        self._done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done:
            self._setup.check()
            self._transfer.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self._setup.finished() and self._transfer.is_completed())

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        # NCCL's future of a send/recv holds the tensor; its value is ready once the transfer is
        self.wait()
        return _future([self._tensor])


class _GroupWork(dist.Work):
    """The work of a coalesced block (`_end_coalescing`): done when each of its transfers is."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return _future([])


def _future(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


# -- the group ---------------------------------------------------------------------------------------


class SimNcclGroup(CarriedGroup):
    """NCCL's behaviour over a Gloo backend (see the module docstring)."""

    #: torch's split_group and new_group ask the backend of a bound group whether it splits
    supports_splitting = True
    #: options split_group copies to the child group (NCCL's; this group has none)
    options = None

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(store, rank, size, timeout)
        self._store = store
        self._timeout = timeout
        #: the simulated GPU of this rank's communicator, set at the group's first collective
        self.gpu: int | None = None
        #: peer -> the set-up of this rank's communicator with it (send/recv)
        self._peers: dict[int, _PairSetup] = {}
        #: point-to-point transfers not known to be finished: kept alive until they are
        self._in_flight: list[_TransferWork] = []
        #: transfers started between `_start_coalescing` and `_end_coalescing`, else None
        self._coalesced: list[dist.Work] | None = None
        #: (task, split) counters: each split rendezvouses under a store prefix of its own
        self._splits = (0, 0)

    def getBackendName(self) -> str:  # torch's name for it
        return NCCL

    # -- the communicator: one GPU per rank ------------------------------------------------

    def _gpu_of(self, tensors: list[torch.Tensor]) -> int:
        indices = {t.device.index or 0 for t in tensors}
        if len(indices) > 1:
            raise ValueError(f"Expected list of tensors on the same device, got tensors on cuda:{sorted(indices)}")
        return indices.pop() if indices else self._guess_gpu()

    def _bind(self, tensors: list[torch.Tensor]) -> None:
        """Set up the communicator on the GPU of `tensors` (checking no two ranks share it)."""
        index = self._gpu_of(tensors)
        if self.gpu is None:
            self._check_distinct(index)
            self.gpu = index
            cuda_memory.note_communicator(index, self)
        elif index != self.gpu:
            raise RuntimeError(
                f"accel.sim: this rank's NCCL communicator is on cuda:{self.gpu}, and this collective's tensors are "
                f"on cuda:{index}. Real NCCL would set up a second communicator for cuda:{index} and wait for every "
                "rank to do the same (a hang unless all do); keep each rank's collectives on one GPU "
                "(torch.cuda.set_device(local_rank) before the first one)."
            )

    def _pair(self, tensor: torch.Tensor, peer: int) -> _PairSetup:
        """send/recv: NCCL sets up a communicator of the two ranks only, once per peer."""
        setup = self._peers.get(peer)
        if setup is None:
            setup = _PairSetup(self._gloo, self.rank(), peer, self._gpu_of([tensor]))
            self._peers[peer] = setup
        return setup

    def bind(self, index: int) -> None:
        """Set up the communicator on simulated GPU `index` now (`init_process_group(device_id=...)`).

        As with NCCL's eager init, the group's `bound_device_id` is then that GPU: barriers
        use it, and `split_group` / `new_group` split subgroups from it.
        """
        gpus = cuda_state.gpus()
        initialized = gpus.initialized
        self._bind([torch.empty(0, device=torch.device("cuda", index))])
        # NCCL sets its communicator up in C++: Python's CUDA (torch.cuda.is_initialized()) stays as it was,
        # so a DeviceMesh made next still pins the GPU of LOCAL_RANK, as on a GPU host
        gpus.initialized = initialized
        self.bound_device_id = torch.device("cuda", index)

    def unbind(self) -> None:
        """Forget the communicator's GPU: the next collective sets it up (and checks it) again.

        A warm rank's group outlives a task; on the hardware each script gets a new one.
        """
        self.gpu = None
        self._peers.clear()
        self._in_flight.clear()
        self._coalesced = None
        self._splits = (self._splits[0] + 1, 0)
        self.bound_device_id = None  # type: ignore[assignment]  # torch's setter takes None (no device)

    def _guess_gpu(self) -> int:
        # As ProcessGroupNCCL for a collective without tensors (barrier): the GPU bound or already used,
        # else the global rank's GPU among the node's (guessDeviceForRank), with its warning.
        if self.gpu is not None:
            return self.gpu
        index = dist.get_rank() % torch.cuda.device_count()
        sys.stderr.write(
            f"[rank{dist.get_rank()}]:[W] ProcessGroupNCCL.cpp] using GPU {index} as device used by this process is "
            "currently unknown. This can potentially cause a hang if this rank to GPU mapping is incorrect. You can "
            "specify device_id in init_process_group() to force use of a particular device.\n"
        )
        return index

    def _check_distinct(self, index: int) -> None:
        if getattr(self._gloo, "alone", False):
            return  # a rank standing in for absent ones (`accel.sim.cuda.nccl.stand_in`): no peer's GPU to compare
        # NCCL tells GPUs apart by their identity on the host, not by the index a process sees
        # (with CUDA_VISIBLE_DEVICES each rank may see only its own GPU, as "cuda:0")
        mine = torch.tensor([cuda_state.gpus().physical_of(index)], dtype=torch.int64)
        gpus = [int(t.item()) for t in self._gathered(mine)]
        for other in range(self.size()):
            for rank in range(other + 1, self.size()):
                if gpus[rank] == gpus[other] and self.rank() in (rank, other):
                    raise duplicate_gpu_error(rank, other, gpus[rank])

    @staticmethod
    def _route(tensors: list[Any]) -> list[torch.Tensor]:
        """The call's tensors, if this group takes them: torch's and NCCL's device errors otherwise."""
        flat = _flatten(tensors)
        cuda = [t for t in flat if is_simulated_cuda(t)]
        if flat and not cuda:
            # torch routes a collective by its tensors' device; this group serves CUDA only
            raise RuntimeError(f"No backend type associated with device type {flat[0].device.type}")
        if len(cuda) != len(flat) or any(t.is_sparse for t in cuda):
            raise ValueError(NOT_CUDA)
        return cuda

    def _run(self, tensors: list[Any], run: Callable[[], None], result: Any) -> Any:
        """Set up the communicator for `tensors`, run `run()` (Gloo, waited), return finished work."""
        routed = self._route(tensors)
        self._bind(routed)
        if not (cuda_shapes.enabled() and any(unwrap(t).is_meta for t in routed)):
            run()  # shapes only: tensors without data exchange nothing
        return torch_internals.completed_work(result)

    @property
    def _device_types(self) -> list[torch.device]:
        # What torch's object collectives ask to pick their device: CUDA, as for NCCL.
        return [torch.device("cuda")]

    # -- collectives: NCCL's checks, then Gloo on the inner tensors ---------------------------
    # The names are those torch.distributed calls (Python) and DDP's reducer calls (C++).

    def _on_gloo(self, method: str, tensors: tuple, result: Any, *rest: Any) -> Any:
        """Gloo's `method` on the inner tensors of `tensors` (then `rest`), after NCCL's device checks."""
        args = rest[:-1] + given(rest[-1]) if rest else ()
        return self._run(list(tensors), lambda: getattr(self._gloo, method)(*_unwrapped(tensors), *args).wait(), result)

    @timed("all_reduce", first)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._route(tensors)
        tensor = _one(tensors)
        _check_tensor(tensor)
        how = _reduction_for(opts, tensor, self.size())
        return self._run([tensor], lambda: self._allreduce(unwrap(tensor), how, opts), [tensor])

    def _allreduce(self, inner: torch.Tensor, how: _Reduction, opts: Any) -> None:
        mine = how.contribution(inner)
        self._gloo.allreduce([mine], how.options(opts, dist.AllreduceOptions)).wait()
        if mine is not inner:
            inner.copy_(mine)
        how.finish(inner)

    @timed("all_reduce", first)
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._route(tensors)
        _check_same_device(tensors)
        how = _reduction_for(opts, tensors[-1], self.size())

        def run() -> None:
            for tensor in tensors:  # one NCCL group call: the same reductions, one after the other
                self._allreduce(unwrap(tensor), how, opts)

        return self._run(tensors, run, tensors)

    @timed("broadcast", first)
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._route(tensors)
        tensor = _one(tensors)
        _check_tensor(tensor)
        _check_dtype(tensor)

        def run() -> None:
            self._gloo.broadcast([_flat(unwrap(tensor))], *given(opts)).wait()

        return self._run([tensor], run, [tensor])

    @timed("reduce", first)
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self._route(tensors)
        tensor = _one(tensors)
        _check_tensor(tensor)
        how = _reduction_for(opts, tensor, self.size())
        root = opts.rootRank if opts is not None else 0

        def run() -> None:
            inner = unwrap(tensor)
            mine = how.contribution(inner, copy=True)  # NCCL leaves the other ranks' tensors as they are
            self._gloo.reduce([mine], how.options(opts, dist.ReduceOptions)).wait()
            if self.rank() == root:
                inner.copy_(mine)
                how.finish(inner)

        return self._run([tensor], run, [tensor])

    @timed("all_gather", first)
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        self._route([outputs, inputs])
        tensor = _one(inputs)
        _check_tensor(tensor)
        _check_dtype(tensor)
        parts = _one(outputs)
        if all(part.shape == parts[0].shape for part in parts):
            # NCCL gathers into one flat buffer, then copies each rank's slice out: counts matter, not shapes
            _check_counts("all_gather", "output", parts, tensor, "copy misaligned slices of its buffer into them")

            def run() -> None:
                for part, piece in zip(parts, self._gathered(_flat(unwrap(tensor)), len(parts)), strict=True):
                    _movable(unwrap(part)).copy_(piece.view(part.shape))

            return self._run([outputs, inputs], run, outputs)
        # outputs of different shapes: NCCL broadcasts each rank's input into its output
        if self.rank() < len(parts) and parts[self.rank()].numel() != tensor.numel():
            raise ValueError("Tensor input and output of _broadcast_oop must have the same number of elements ")
        return self._run([outputs, inputs], lambda: self._broadcast_each(parts, tensor), outputs)

    def _broadcast_each(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        for root, part in enumerate(parts):
            target = _movable(unwrap(part))
            buffer = _flat(unwrap(tensor)).clone() if root == self.rank() else target.new_empty(target.numel())
            self._broadcast(buffer, root)
            target.copy_(buffer.view(target.shape))

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        raise NotImplementedError("ProcessGroupNCCL does not support allgather_coalesced")

    @timed("all_gather", first)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._route([output, input])
        self._check_gather(output, input)
        return self._run([output, input], lambda: self._gather_flat(unwrap(output), unwrap(input)), [output])

    def _check_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        _check_tensor(input)
        _check_tensor(output)
        if input.dtype != output.dtype:
            raise TypeError("output tensor must have the same type as input tensor")
        if input.numel() * self.size() != output.numel():
            raise ValueError("output tensor size must be equal to world_size times input tensor size")
        _check_dtype(input)

    def _gather_flat(self, output: torch.Tensor, input: torch.Tensor) -> None:
        # Gloo checks shapes; NCCL sends buffers: both as 1-D views of the same memory
        if input.numel():
            torch_internals.gloo_all_gather_single(self._gloo, _flat(output), _flat(input)).wait()

    @timed("all_gather", first)
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        # one NCCL group call: every pair checked before any runs (not carried's one call after another)
        self._route([outputs, inputs])
        pairs = list(zip(outputs, inputs, strict=True))
        for output, input in pairs:
            self._check_gather(output, input)

        def run() -> None:
            for output, input in pairs:
                self._gather_flat(unwrap(output), unwrap(input))

        return self._run([outputs, inputs], run, outputs)

    @timed("reduce_scatter", second)
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        self._route([outputs, inputs])
        output = _one(outputs)
        _check_tensor(output)
        how = _reduction_for(opts, output, self.size())
        parts = _one(inputs)
        if all(part.shape == parts[0].shape for part in parts):
            _check_counts("reduce_scatter", "input", parts, output, "reduce misaligned slices")

            def run() -> None:
                flat = torch.cat([unwrap(part).reshape(-1) for part in parts])  # NCCL copies them into one buffer
                self._scatter_flat(unwrap(output), how.contribution(flat), how, opts)

            return self._run([outputs, inputs], run, outputs)
        # inputs of different shapes: NCCL reduces each rank's part onto that rank
        if self.rank() < len(parts) and parts[self.rank()].numel() != output.numel():
            raise ValueError("Tensor input and output of _reduce_oop must have the same number of elements ")
        return self._run([outputs, inputs], lambda: self._reduce_each(parts, output, how, opts), outputs)

    def _reduce_each(self, parts: list[torch.Tensor], output: torch.Tensor, how: _Reduction, opts: Any) -> None:
        for root, part in enumerate(parts):
            mine = how.contribution(unwrap(part).reshape(-1), copy=True)
            options = how.options(opts, dist.ReduceOptions)
            options.rootRank = root
            self._gloo.reduce([mine], options).wait()
            if root == self.rank():
                target = unwrap(output)
                _flat(target).copy_(mine)
                how.finish(target)

    @timed("reduce_scatter", second)
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._route([output, input])
        how = self._check_scatter(output, input, opts)

        def run() -> None:
            self._scatter_flat(unwrap(output), how.contribution(_flat(unwrap(input)), copy=True), how, opts)

        return self._run([output, input], run, [output])

    def _check_scatter(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Reduction:
        if input.dtype != output.dtype:
            raise TypeError("input tensor must be the same type as the output tensor.")
        if input.numel() != output.numel() * self.size():
            raise ValueError("input tensor must be the same size as output size times world size")
        _check_tensor(input)
        _check_tensor(output)
        return _reduction_for(opts, output, self.size())

    def _scatter_flat(self, output: torch.Tensor, contribution: torch.Tensor, how: _Reduction, opts: Any) -> None:
        """Reduce-scatter `contribution` (a 1-D tensor Gloo may overwrite) into `output`, as one buffer."""
        if output.numel():
            options = how.options(opts, dist.ReduceScatterOptions)
            torch_internals.gloo_reduce_scatter_single(self._gloo, _flat(output), contribution, options).wait()
        how.finish(output)

    @timed("reduce_scatter", second)
    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._route([outputs, inputs])
        pairs = list(zip(outputs, inputs, strict=True))
        hows = [self._check_scatter(output, input, opts) for output, input in pairs]

        def run() -> None:
            for (output, input), how in zip(pairs, hows, strict=True):
                self._scatter_flat(unwrap(output), how.contribution(_flat(unwrap(input)), copy=True), how, opts)

        return self._run([outputs, inputs], run, outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("gather", (outputs, inputs), outputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self._on_gloo("scatter", (outputs, inputs), outputs, opts)

    @timed("all_to_all", second)
    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> Any:
        self._route([output, input])
        _check_tensor(output)
        _check_tensor(input)
        if not out_splits and not in_splits:
            # NCCL's equal split: numel / size elements to each rank, whatever the shapes
            if output.numel() != input.numel():
                raise ValueError(
                    f"accel.sim: all_to_all_single without split sizes sends {input.numel()} elements and receives "
                    f"into {output.numel()}; NCCL would write past the output or leave part of it (undefined "
                    "behaviour). Give tensors of the same number of elements, or split sizes."
                )
            count = input.numel() // self.size() * self.size()

            def run() -> None:
                if count:
                    self._gloo.alltoall_base(_flat(unwrap(output))[:count], _flat(unwrap(input))[:count], [], []).wait()

            return self._run([output, input], run, [output])
        for splits, tensor in ((in_splits, input), (out_splits, output)):
            self._check_splits(list(splits), tensor)

        def run_uneven() -> None:
            received, sent = _movable(unwrap(output)), _movable(unwrap(input))
            self._gloo.alltoall_base(received, sent, list(out_splits), list(in_splits)).wait()

        return self._run([output, input], run_uneven, [output])

    def _check_splits(self, splits: list[int], tensor: torch.Tensor) -> None:
        # c10d's checkSplitSizes (NCCL's all_to_all_single with split sizes)
        if not splits:
            if tensor.dim() == 0 or tensor.size(0) % self.size():
                raise RuntimeError("Tensor's dim 0 does not divide equally across group size")
            return
        if len(splits) != self.size():
            raise RuntimeError("Number of tensor splits not equal to group size")
        if sum(splits) != (tensor.size(0) if tensor.dim() else 1):
            raise RuntimeError("Split sizes doesn't match total dim 0 size")

    @timed("all_to_all", second)
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        self._route([outputs, inputs])
        for output, input in zip(outputs, inputs, strict=False):
            _check_tensor(output)
            _check_tensor(input)
            if output.device != outputs[0].device or input.device != outputs[0].device:
                raise RuntimeError("Tensors must be on the same device")
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise ValueError(
                f"accel.sim: all_to_all takes one tensor per rank ({self.size()}); got {len(inputs)} inputs and "
                f"{len(outputs)} outputs (NCCL would address ranks the group does not have)"
            )

        def run() -> None:
            # NCCL sends inputs[r] to rank r and receives outputs[r] from it, each of its own
            # size: one Gloo all-to-all of the concatenated buffers, split by element counts
            sent = torch.cat([_flat(unwrap(t)) for t in inputs])
            received = torch.empty(sum(t.numel() for t in outputs), dtype=sent.dtype)
            out_counts, in_counts = [t.numel() for t in outputs], [t.numel() for t in inputs]
            self._gloo.alltoall_base(received, sent, out_counts, in_counts).wait()
            for output, piece in zip(outputs, received.split(out_counts), strict=True):
                _flat(unwrap(output)).copy_(piece)

        return self._run([outputs, inputs], run, outputs)

    # -- point-to-point: under way when returned, as with NCCL ----------------------------------

    @timed("send", first)
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        return self._transfer(tensors, dstRank, lambda inner: self._gloo.send([inner], dstRank, tag))

    @timed("send", first)
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        return self._transfer(tensors, srcRank, lambda inner: self._gloo.recv([inner], srcRank, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise NotImplementedError("ProcessGroupNCCL does not support recvAnysource")

    def _transfer(self, tensors: list[torch.Tensor], peer: int, start: Callable[[torch.Tensor], Any]) -> Any:
        self._route(tensors)
        tensor = _one(tensors)
        _check_tensor(tensor, p2p=True)
        _check_dtype(tensor)
        if cuda_shapes.enabled() and unwrap(tensor).is_meta:
            return torch_internals.completed_work([tensor])  # shapes only: nothing to send or receive
        setup = self._pair(tensor, peer)
        work = _TransferWork(setup, start(_flat(unwrap(tensor))), tensor)
        self._in_flight = [w for w in self._in_flight if not w.is_completed()] + [work]
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _start_coalescing(self, device: torch.device) -> None:
        """`_coalescing_manager(device=...)`: collect the block's transfers into one work."""
        self._coalesced = []

    def _end_coalescing(self, device: torch.device) -> Any:
        works, self._coalesced = self._coalesced or [], None
        return _GroupWork(works)

    def barrier(self, opts: Any = None) -> Any:
        # NCCL's barrier is an all-reduce on a GPU: the first of `device_ids`, else the one the group
        # knows, else the rank's guess (`_guess_gpu`)
        ids = list(getattr(opts, "device_ids", None) or [])
        index = ids[0] if ids else self._guess_gpu()
        self._bind([torch.empty(0, device=torch.device("cuda", index))])
        self._gloo.barrier(*given(opts)).wait()
        return torch_internals.completed_work([])

    # -- subgroups: what torch asks of a backend that splits -------------------------------------

    def _get_backend(self, device: Any) -> Any:
        """The backend of `device`: this group itself for CUDA (torch's split_group and new_group ask)."""
        kind = torch.device(device).type
        if kind not in ("cuda", cuda_state.HIDDEN_DEVICE):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    def get_group_store(self) -> Any:
        return self._store

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to number: torch calls it on each new group's backend."""

    def eager_connect_single_device(self, device: torch.device | None) -> None:
        """new_group of a bound default group: NCCL sets up the subgroup's communicator at once."""
        if device is not None:
            self.bind(device.index or 0)

    def perform_nocolor_split(self, device: torch.device) -> None:
        """A rank outside a new subgroup: NCCL's split involves it; this group's subgroups do not."""

    def split_group(
        self,
        ranks: list[int],
        timeout: datetime.timedelta | None = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> SimNcclGroup | None:
        """`torch.distributed.split_group`: a group of `ranks` (ranks of this group), on this rank's GPU.

        Only the members set it up (ncclCommSplit involves every rank of the parent; the
        result is the same): each runs its own Gloo group under the child's name.
        """
        # Every rank of the parent counts the split (torch has them all call it). The count
        # makes the store prefix unique: torch's names repeat from one task to the next, and
        # this group (and its store) outlives tasks; old keys would point Gloo at dead peers.
        self._splits = (self._splits[0], self._splits[1] + 1)
        if self.rank() not in ranks:
            return None
        name = group_name or f"split:{','.join(map(str, sorted(ranks)))}"
        store = dist.PrefixStore(f"{name}/{self._splits[0]}.{self._splits[1]}/", self._store)
        child = type(self)(store, sorted(ranks).index(self.rank()), len(ranks), timeout or self._timeout)
        child._set_group_name(name)
        child._set_group_desc(group_desc or f"{self.group_desc}:split")
        if self.gpu is not None:
            child.bind(self.gpu)  # a split communicator lives on its parent's GPU
        return child


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> SimNcclGroup:
    return SimNcclGroup(store, rank, size, timeout)


# -- "nccl" in the words of torch.distributed ---------------------------------------------------


def to_torch(backend: Any) -> Any:
    """The backend string torch must be given for `backend` ("nccl" -> this group), else unchanged.

    "cpu:gloo,cuda:nccl" (CPU tensors over Gloo, CUDA ones NCCL's way) is the simulated
    GPU's permissive group (`accel.sim.cuda.nccl.mixed_group`): a Python group serves every device
    of its process group, so this one could not share one with Gloo.
    """
    if backend is None:
        return None
    text = str(backend).lower()
    if text == NCCL:
        return BACKEND
    if ":" in text:
        pairs = dict(pair.strip().split(":", 1) for pair in text.split(","))
        if pairs == {"cuda": NCCL}:
            return BACKEND
        if pairs == {"cpu": "gloo", "cuda": NCCL}:
            return MIXED_BACKEND
    return backend


def to_user(backend: str) -> str:
    """`backend` as torch reports it, with this group named "nccl"."""
    return backend.replace(BACKEND, NCCL) if isinstance(backend, str) else backend


_installed: list[tuple[Any, str, Any]] = []


def install() -> None:
    """Register the group and make `torch.distributed` call it "nccl" (once per simulated GPU rank)."""
    if _installed:
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cuda", cuda_state.HIDDEN_DEVICE])
    torch_internals.keep_python_groups_out_of_splits(SimNcclGroup)  # it splits on its own (split_group)
    original_new_group = distributed_c10d.new_group

    @functools.wraps(original_new_group)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        if len(args) >= 3:
            args = (*args[:2], to_torch(args[2]), *args[3:])
        if "backend" in kwargs:
            kwargs["backend"] = to_torch(kwargs["backend"])
        return original_new_group(*args, **kwargs)

    def is_nccl_available() -> bool:
        return True

    def nccl_version() -> tuple[int, int, int]:
        return NCCL_VERSION

    # is_nccl_available in `torch.distributed` only: torch's own code asks distributed_c10d's
    # before it takes its branch for the real library. (`get_backend`: accel.sim.runtime.adopt_group.)
    patches = [
        (dist, "is_nccl_available", is_nccl_available),
        (dist, "new_group", new_group),
        (distributed_c10d, "new_group", new_group),
        (torch.cuda.nccl, "version", nccl_version),
    ]
    for module, name, replacement in patches:
        _installed.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)
