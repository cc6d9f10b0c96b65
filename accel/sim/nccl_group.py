"""The "nccl" process group of a simulated GPU rank: NCCL's rules, carried by Gloo.

A CPU-only torch has no NCCL, so in a simulated GPU rank `init_process_group("nccl")`
creates a `SimNcclGroup`: a Python process-group backend that takes simulated CUDA
tensors, hands their inner CPU tensors to a `ProcessGroupGloo`, and gives the caller's
CUDA tensors back. What NCCL refuses, it refuses with NCCL's words:

* a CPU tensor as the tensor a collective runs on: torch itself says "No backend type
  associated with device type cpu" (the group serves CUDA devices only, as NCCL does);
* a CPU tensor among CUDA ones (an output list, a send buffer): "Tensors must be CUDA
  and dense" (a ValueError, as ProcessGroupNCCL raises it);
* two ranks of the group working on the same GPU (a forgotten
  `torch.cuda.set_device(local_rank)`): NCCL's "Duplicate GPU detected" when the group's
  communicator is set up, at its first collective, on every rank.

The torch name of this backend is `BACKEND` ("sim_nccl": torch's "nccl" branch wants the
real library); `install()` makes the rest of `torch.distributed` speak of it as "nccl":
`get_backend()` says "nccl" (`accel.sim.adopt_group`), `is_nccl_available()` is true, and `"nccl"` given to
`new_group` (or to `init_process_group`, see `accel.sim.adopt_group`) means this group.
Installed only in simulated GPU ranks.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from accel.sim import cuda_state, torch_internals
from accel.sim.cuda_group import PythonGroup
from accel.sim.cuda_tensor import is_simulated_cuda, unwrap

#: the name torch knows this backend by
BACKEND = "sim_nccl"
#: the name user code knows it by
NCCL = "nccl"

#: what `torch.cuda.nccl.version()` says in a simulated GPU rank (torch's logging of a failed
#: collective on a "nccl" group asks for it)
NCCL_VERSION = (2, 21, 5)

#: Gloo tag of the messages that set up a point-to-point communicator (apart from the user's)
PAIR_TAG = 0x5EC0

#: ProcessGroupNCCL's words for a tensor it cannot take
NOT_CUDA = "Tensors must be CUDA and dense"


def duplicate_gpu_error(rank: int, other: int, index: int) -> dist.DistBackendError:
    """What NCCL raises when two ranks of one communicator use the same GPU."""
    return dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp, invalid usage (run with NCCL_DEBUG=WARN for details), "
        "NCCL version (simulated)\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "Last error:\n"
        f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device {index}\n"
        f"(accel.sim: ranks {other} and {rank} both ran their first collective on simulated cuda:{index}; on a "
        "real node each process must call torch.cuda.set_device(local_rank) before it communicates)"
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


class SimNcclGroup(PythonGroup):
    """NCCL's behaviour over a Gloo backend (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
        #: the simulated GPU of this rank's communicator, set at the group's first collective
        self.gpu: int | None = None
        #: peer -> this rank's GPU, for the point-to-point communicators set up so far
        self._peers: dict[int, int] = {}

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
        elif index != self.gpu:
            raise RuntimeError(
                f"accel.sim: this rank's NCCL communicator is on cuda:{self.gpu}, and this collective's tensors are "
                f"on cuda:{index}. Real NCCL would set up a second communicator for cuda:{index} and wait for every "
                "rank to do the same (a hang unless all do); keep each rank's collectives on one GPU "
                "(torch.cuda.set_device(local_rank) before the first one)."
            )

    def _bind_pair(self, tensors: list[torch.Tensor], peer: int, sending: bool) -> None:
        """send/recv: NCCL sets up a communicator of the two ranks only, once per peer."""
        index = self._gpu_of(tensors)
        if peer in self._peers:
            return
        mine, theirs = torch.tensor([index], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        steps = [lambda: self._gloo.send([mine], peer, PAIR_TAG), lambda: self._gloo.recv([theirs], peer, PAIR_TAG)]
        for step in steps if sending else steps[::-1]:
            step().wait()
        if int(theirs.item()) == index:
            raise duplicate_gpu_error(max(self.rank(), peer), min(self.rank(), peer), index)
        self._peers[peer] = index

    def bind(self, index: int) -> None:
        """Set up the communicator on simulated GPU `index` now (`init_process_group(device_id=...)`)."""
        self._bind([torch.empty(0, device=torch.device("cuda", index))])

    def unbind(self) -> None:
        """Forget the communicator's GPU: the next collective sets it up (and checks it) again.

        A warm rank's group outlives a task; on the hardware each script gets a new one.
        """
        self.gpu = None
        self._peers.clear()

    def _guess_gpu(self) -> int:
        # As ProcessGroupNCCL for a collective without tensors (barrier): the GPU already
        # used, else the current one.
        return self.gpu if self.gpu is not None else torch.cuda.current_device()

    def _check_distinct(self, index: int) -> None:
        mine = torch.tensor([index], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size())]
        self._gloo.allgather([everyone], [mine]).wait()
        gpus = [int(t.item()) for t in everyone]
        for other in range(self.size()):
            for rank in range(other + 1, self.size()):
                if gpus[rank] == gpus[other] and self.rank() in (rank, other):
                    raise duplicate_gpu_error(rank, other, gpus[rank])

    def _run(
        self, tensors: list[Any], start: Callable[[], Any], result: Any, peer: tuple[int, bool] | None = None
    ) -> Any:
        """Check the call's tensors as NCCL would, run `start()` on Gloo, return finished work."""
        flat = _flatten(tensors)
        cuda = [t for t in flat if is_simulated_cuda(t)]
        if flat and not cuda:
            # torch routes a collective by its tensors' device; this group serves CUDA only
            raise RuntimeError(f"No backend type associated with device type {flat[0].device.type}")
        if len(cuda) != len(flat) or any(t.is_sparse for t in cuda):
            raise ValueError(NOT_CUDA)
        if peer is None:
            self._bind(cuda)
        else:
            self._bind_pair(cuda, *peer)
        start().wait()
        return torch_internals.completed_work(result)

    @property
    def _device_types(self) -> list[torch.device]:
        # What torch's object collectives ask to pick their device: CUDA, as for NCCL.
        return [torch.device("cuda")]

    # -- collectives: NCCL's checks, then Gloo on the inner tensors ---------------------------
    # The names are those torch.distributed calls (Python) and DDP's reducer calls (C++).

    def _on_gloo(self, method: str, tensors: tuple, result: Any, *rest: Any) -> Any:
        """Gloo's `method` on the inner tensors of `tensors` (then `rest`), after NCCL's checks."""
        args = rest[:-1] + _given(rest[-1]) if rest else ()
        return self._run(list(tensors), lambda: getattr(self._gloo, method)(*_unwrapped(tensors), *args), result)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("allreduce", (tensors,), tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("allreduce_coalesced", (tensors,), tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("broadcast", (tensors,), tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("reduce", (tensors,), tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("allgather", (outputs, inputs), outputs, opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._on_gloo("allgather_coalesced", (outputs, inputs), outputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._on_gloo("_allgather_base", (output, input), [output], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._on_gloo("allgather_into_tensor_coalesced", (outputs, inputs), outputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self._on_gloo("reduce_scatter", (outputs, inputs), outputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._on_gloo("_reduce_scatter_base", (output, input), [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._on_gloo("reduce_scatter_tensor_coalesced", (outputs, inputs), outputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("gather", (outputs, inputs), outputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self._on_gloo("scatter", (outputs, inputs), outputs, opts)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> Any:
        return self._on_gloo("alltoall_base", (output, input), [output], out_splits, in_splits, opts)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._on_gloo("alltoall", (outputs, inputs), outputs, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        start = lambda: self._gloo.send(_unwrapped(tensors), dst, tag)  # noqa: E731
        return self._run([tensors], start, tensors, peer=(dst, True))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        start = lambda: self._gloo.recv(_unwrapped(tensors), src, tag)  # noqa: E731
        return self._run([tensors], start, tensors, peer=(src, False))

    def barrier(self, opts: Any = None) -> Any:
        # NCCL's barrier is an all-reduce on a GPU: the first of `device_ids`, else the
        # communicator's, else the current one (see torch.distributed.barrier).
        ids = list(getattr(opts, "device_ids", None) or [])
        index = ids[0] if ids else self._guess_gpu()
        self._bind([torch.empty(0, device=torch.device("cuda", index))])
        self._gloo.barrier(*_given(opts)).wait()
        return torch_internals.completed_work([])


def _given(opts: Any) -> tuple[Any, ...]:
    # Gloo's methods have their own default options; pass ours only when we have some.
    return () if opts is None else (opts,)


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> SimNcclGroup:
    return SimNcclGroup(store, rank, size, timeout)


# -- "nccl" in the words of torch.distributed ---------------------------------------------------


def to_torch(backend: Any) -> Any:
    """The backend string torch must be given for `backend` ("nccl" -> this group), else unchanged.

    "cpu:gloo,cuda:nccl" (CPU tensors over Gloo, CUDA ones NCCL's way) is the simulated
    GPU's permissive group (`accel.sim.cuda_group`): a Python group serves every device
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
            from accel.sim import cuda_group

            return cuda_group.BACKEND_NAME
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
    # before it takes its branch for the real library. (`get_backend`: accel.sim.adopt_group.)
    patches = [
        (dist, "is_nccl_available", is_nccl_available),
        (dist, "new_group", new_group),
        (distributed_c10d, "new_group", new_group),
        (torch.cuda.nccl, "version", nccl_version),
    ]
    for module, name, replacement in patches:
        _installed.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)
