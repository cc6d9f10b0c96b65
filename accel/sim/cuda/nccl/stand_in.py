"""In a rank that stands in for others: collectives that complete without the ranks not run.

A shapes-only run of a big world (`accel launch --simulate cuda --shapes_only --num_processes 64
--only_ranks 0,63`, `accel.sim.launch(..., only_ranks=...)`) runs only some of its ranks, each
as rank R of the full world: the torchrun environment, `dist.get_world_size()`, the DeviceMesh,
the shards FSDP and tensor parallelism give it are those of the full run. Its process groups
are the simulated NCCL group (`accel.sim.cuda.nccl.process_group`: NCCL's checks, its communicators'
memory) as in a full run, but carried by `Alone` instead of a Gloo group: every collective
completes at once, on this rank alone. The outputs are the caller's own tensors, of the shapes
and dtypes the collective gives them, so the memory this rank's GPU holds is counted as in the
full run (the tensors are allocated by torch and the libraries, not by the group). Subgroups
(`new_group`, `split_group`, DeviceMesh's) are created without waiting for anyone.

What a collective leaves in its outputs: nothing is exchanged, so, with shapes only, tensors
without data stay without data (as in any shapes-only run), and those that keep data (up to
64 KiB: sizes, object collectives' bytes, counts) come out as if every member of the group held
what this rank holds: an all-gather gives copies of this rank's input, a sum `size` times it,
a maximum the input itself, a broadcast leaves this rank's tensor as it is. So
`all_gather_object` gives this rank's object for every rank, and control flow that every rank
takes alike takes the same turn here. A point-to-point receive leaves its tensor as it was:
what the peer sends has no symmetric answer (pipeline stages differ); one of integers that keep
their data (sizes, shapes a pipeline stage sends the next) fails with `AbsentRanks`, since they
would steer the receiver wrong.

What cannot be stood in for fails at once, naming it: anything that waits in the store for a
rank not run (a Gloo group the script makes itself, torch's store barrier) gets `AbsentRanks`
from the rank's `StandInStore`. Installed by the rank's set-up (`accel.sim.runtime.worker`),
before its default group is created.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from accel.sim.core import carried
from accel.sim.core.carried import PythonGroup, completed_work
from accel.sim.cuda.gpus import shapes as cuda_shapes
from accel.sim.cuda.gpus.errors import SimulatedDeviceError
from accel.sim.cuda.nccl.process_group import PAIR_TAG
from accel.sim.runtime import adopt_group

__all__ = ["AbsentRanks", "Alone", "StandInStore", "install", "uninstall"]

_RedOp: Any = dist.ReduceOp.RedOpType  # its stubs declare no members


class AbsentRanks(SimulatedDeviceError):
    """Something waits for a rank this run does not run (`--only_ranks`)."""


def _ops(opts: Any) -> Any:
    """The reduction of `opts` (options, a ReduceOp or None) as a RedOpType."""
    op = getattr(opts, "reduceOp", opts)
    op = dist.ReduceOp.SUM if op is None else op
    return getattr(op, "op", op)


def _holds_data(*tensors: torch.Tensor) -> bool:
    return all(isinstance(t, torch.Tensor) and not t.is_meta for t in tensors)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target` = `source`'s elements (in order), where both hold data and their counts agree."""
    if _holds_data(target, source) and target.numel() == source.numel():
        target.copy_(source.reshape(target.shape))


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


class Alone(PythonGroup):
    """Carries a group's collectives in a rank whose peers are not run: each completes at once.

    It answers the calls the simulated groups make of the Gloo group it replaces
    (`accel.sim.core.carried.carrier`), on host tensors, with the values of a group whose
    members all hold what this rank holds (see the module docstring).
    """

    #: the simulated NCCL group skips what needs its peers (NCCL's "Duplicate GPU" check)
    alone = True

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # torch's name for a backend
        return "accel_sim_alone"

    def _done(self, result: Any = None) -> Any:
        if not cuda_shapes.enabled():
            raise SimulatedDeviceError(
                "accel.sim: this rank stands in for ranks that are not run (only_ranks), which is meaningful with "
                "shapes only: a collective here would compute values the absent ranks never sent. Run with "
                "--shapes_only (shapes_only=True, ACCEL_SIM_SHAPES_ONLY=1), or run every rank."
            )
        return completed_work([] if result is None else result)

    def _reduce(self, tensor: torch.Tensor, opts: Any) -> None:
        """`tensor` reduced over `size` members that each hold it, in place."""
        if not _holds_data(tensor) or tensor.dtype == torch.bool:
            return  # or / and / max / min of equal booleans: the same booleans
        kind = _ops(opts)
        if kind == _RedOp.SUM:
            tensor.mul_(self.size())
        elif kind == _RedOp.PRODUCT:
            tensor.pow_(self.size())
        elif kind == _RedOp.BXOR and self.size() % 2 == 0:
            tensor.zero_()
        # MIN, MAX, BAND, BOR (and AVG, which the simulated NCCL group turns into a SUM first): unchanged

    # -- the collectives, as Gloo's Python binding names them --------------------------------

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for parts, tensor in zip(outputs, inputs, strict=True):
            for part in parts:
                _copy(part, tensor)
        return self._done(outputs)

    allgather_coalesced = allgather

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if _holds_data(output, input) and output.numel() == input.numel() * self.size():
            output.copy_(input.reshape(-1).repeat(self.size()).reshape(output.shape))
        return self._done([output])

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        for tensor in _as_list(tensors):
            self._reduce(tensor, opts)
        return self._done(_as_list(tensors))

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        return self._done(_as_list(tensors))  # the root's tensor is taken to be this rank's

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        if getattr(opts, "rootRank", 0) == self.rank():
            for tensor in _as_list(tensors):
                self._reduce(tensor, opts)
        return self._done(_as_list(tensors))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        for output, parts in zip(outputs, inputs, strict=True):
            _copy(output, parts[self.rank()])
            self._reduce(output, opts)
        return self._done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        count = output.numel()
        if _holds_data(output, input) and input.numel() == count * self.size():
            _copy(output, input.reshape(-1).narrow(0, self.rank() * count, count))
            self._reduce(output, opts)
        return self._done([output])

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> Any:
        """Each member sends this rank what this rank sends itself (its own part, where the sizes agree)."""
        if _holds_data(output, input) and output.numel():
            size, me = self.size(), self.rank()
            rows = output.shape[0] if output.dim() else 1
            width = output.numel() // max(rows, 1)
            ins = list(in_splits) or [input.numel() // width // size] * size
            outs = list(out_splits) or [rows // size] * size
            own = input.reshape(-1).narrow(0, sum(ins[:me]) * width, ins[me] * width)
            for peer, start in enumerate(_starts(outs)):
                piece = output.reshape(-1).narrow(0, start * width, outs[peer] * width)
                if outs[peer] == ins[me]:
                    piece.copy_(own)
                else:
                    piece.zero_()  # a part of another size than this rank's own: no symmetric answer
        return self._done([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for output in outputs:
            _copy(output, inputs[self.rank()])
        return self._done(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        if getattr(opts, "rootRank", 0) == self.rank():
            for part in outputs[0] if outputs else []:
                _copy(part, inputs[0])
        return self._done(outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        if getattr(opts, "rootRank", 0) == self.rank() and inputs:
            _copy(outputs[0], inputs[0][self.rank()])
        return self._done(outputs)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        return self._done(tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        if tag != PAIR_TAG:  # (the pair's set-up: each sends the other its GPU, checked only against its own)
            _refuse_steering_values(tensors, f"rank {srcRank} of the group")
        return self._done(tensors)  # what the peer would send is not known: the tensor is left as it is

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        _refuse_steering_values(tensors, "any rank")
        return self._done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return self._done()


def _refuse_steering_values(tensors: list[torch.Tensor], peer: str) -> None:
    """A point-to-point receive of integers (sizes, counts, shapes a pipeline stage sends the next) cannot be
    stood in for: left as they were, they would steer the receiver wrong (a pipeline stage allocating for
    garbage shapes runs "out of memory" by terabytes). Activations (floating point) are left as they are."""
    for tensor in tensors:
        if _holds_data(tensor) and not tensor.is_floating_point() and not tensor.is_complex():
            raise AbsentRanks(
                f"accel.sim: this rank receives {tensor.dtype} values ({tuple(tensor.shape)}) from {peer} point to "
                "point, which a rank standing in for others cannot know: what one rank sends another (sizes and "
                "shapes between pipeline stages) differs from what it holds itself. Run every rank of a pipeline-"
                "parallel layout (no --only_ranks)."
            )


def _starts(counts: list[int]) -> list[int]:
    """Where each of consecutive parts of `counts` elements starts."""
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


class StandInStore(dist.Store):
    """The rank's own key-value store: what it set, it reads; a key only absent ranks would set raises `AbsentRanks`.

    Gloo's rendezvous and torch's store barrier wait for keys their peers set: they fail at
    once, naming the cause, instead of waiting out their timeout.
    """

    def __init__(self, description: str) -> None:
        super().__init__()
        self._values: dict[str, bytes] = {}
        self._description = description

    def _absent(self, keys: list[str]) -> AbsentRanks:
        return AbsentRanks(
            f"accel.sim: this rank waits for key(s) {', '.join(keys)} of the store, which only ranks this run does "
            f"not run would set ({self._description}). What waits for other ranks outside the simulated NCCL "
            "groups cannot be stood in for: a Gloo group the script creates (CPU collectives), torch's store "
            "barrier (TORCH_DIST_INIT_BARRIER=1). Run every rank (no --only_ranks) to run them."
        )

    def set(self, key: str, value: Any) -> None:
        self._values[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        if key not in self._values:
            raise self._absent([key])
        return self._values[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self._values.get(key, b"0")) + amount
        self._values[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        current = self._values.get(key)
        expected = expected if isinstance(expected, bytes) else str(expected).encode()
        if (current is None and not expected) or current == expected:
            self.set(key, desired)
        return self._values.get(key, expected)

    def check(self, keys: list[str]) -> bool:
        return all(key in self._values for key in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        missing = [key for key in keys if key not in self._values]
        if missing:
            raise self._absent(missing)


#: the stores made here: torch holds a store written in Python by its C++ side only, which does not keep the
#: Python object alive (its methods would be gone: "Tried to call pure virtual function")
_stores: list[StandInStore] = []


def _kept(store: StandInStore) -> StandInStore:
    _stores.append(store)
    return store


def install(description: str) -> None:
    """From now on, this rank's groups are carried by `Alone` and its default groups keep a `StandInStore`.

    `description` says which ranks run, for the errors of what waits for the others.
    """
    carried.carry_with(Alone)
    adopt_group.use_stores(lambda: _kept(StandInStore(description)))


def uninstall() -> None:
    """Groups are carried by Gloo again, and stored in the launcher's store (tests)."""
    carried.carry_with(None)
    adopt_group.use_stores(None)
