"""Inside a rank: watch every `torch.distributed` collective the code calls.

Each public collective function (`dist.all_reduce`, `dist.broadcast`, ... also the
object ones) is wrapped, in `torch.distributed` and in `torch.distributed.distributed_c10d`,
so that calls through either name, and the simulated GPU's process group (which runs
on Gloo under those same functions), are all seen. A collective called from inside
another (`all_gather_object` calls `all_gather`) counts once, as the outer one. Per call:

- **faults**: the rank's N-th collective of the task may fire an injected fault
  (`accel.sim.diagnoses.faults`);
- **board**: the rank writes "waiting in <op>, collective #n, group ranks" to a small
  memory-mapped file before the call and "idle" after it; the parent reads it to see
  that ranks wait in a collective whose peers have already finished (a deadlock), and
  says so at once instead of at the timeout;
- **check** (on by default, `check_collectives=False` turns it off): before the call, every
  rank of the group publishes the collective's signature (op, tensor shapes and dtypes,
  root, reduce op) under the group's sequence number and reads the others'. Different
  signatures raise `CollectiveMismatch` in every rank of the group, naming each rank's
  collective and the line of the user's code that called it. The signatures go through
  the rendezvous store; with `ACCEL_SIM_CHECK_EXCHANGE=shm` they go through memory the
  pool's ranks share instead (`_Exchange`: one slot per rank, peers woken with a futex;
  Linux on x86-64 or arm64), which costs no round trip to the store. It is opt-in since a
  full suite saw it leave two ranks of four waiting: they had read a slot half rewritten
  (its rank preempted mid-copy) that parsed as another signature, saw a mismatch no other
  rank saw and waited for the others' details; slots now carry a checksum (`_Exchange`). A
  mismatch's details (full signatures, where each was called) always go through the store.

A step every rank of a group must reach together that is not a collective of its own
(the simulated TPU's `xm` collectives creating their replica groups) goes through
`joint_step`: shown on the board and checked as a collective of that group.

Why not torch's own checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, the `ProcessGroupWrapper`
of `dist._create_process_group_wrapper`)? It compares the same fingerprint (op, shapes,
dtypes, sequence number) but wraps C++ backends only, so the simulated GPU's Python
process group escapes it, its report knows no Python location, and DETAIL also turns on
torch's other debug checks. `benchmarks/bench_collective_check.py` measures both.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import hashlib
import inspect
import json
import mmap
import os
import platform
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from accel.sim import real_time
from accel.sim.core import torch_internals
from accel.sim.diagnoses import faults
from accel.sim.diagnoses.deadlock import BOARD_SIZE, board_path, ranges
from accel.sim.diagnoses.failures import CollectiveMismatch

T = TypeVar("T")

#: seconds a rank waits for its peers' signatures before giving up (the parent's
#: deadlock check and the task's timeout usually end the wait much earlier); the
#: launch's environment may say otherwise (ACCEL_SIM_CHECK_TIMEOUT)
CHECK_TIMEOUT = 1800.0


def check_timeout() -> float:
    """Seconds a rank waits in the check for its peers (ACCEL_SIM_CHECK_TIMEOUT, default 1800)."""
    return float(os.environ.get("ACCEL_SIM_CHECK_TIMEOUT", CHECK_TIMEOUT))


#: collective -> (tensor arguments whose shape and dtype must agree, other arguments that must agree)
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("tensor",), ("op",)),
    "all_reduce_coalesced": (("tensors",), ("op",)),
    "broadcast": (("tensor",), ("src", "group_src")),
    "reduce": (("tensor",), ("dst", "op", "group_dst")),
    "all_gather": (("tensor",), ()),
    "all_gather_into_tensor": (("input_tensor",), ()),
    "all_gather_single": (("input_tensor",), ()),
    "reduce_scatter": (("output",), ("op",)),
    "reduce_scatter_tensor": (("input",), ("op",)),
    "reduce_scatter_single": (("input",), ("op",)),  # what torch 2.14 has reduce_scatter_tensor's callers use
    "all_to_all": ((), ()),
    "all_to_all_single": ((), ()),
    "gather": (("tensor",), ("dst", "group_dst")),
    "scatter": (("tensor",), ("src", "group_src")),
    "barrier": ((), ()),
    "all_gather_object": ((), ()),
    "broadcast_object_list": ((), ("src", "group_src")),
    "gather_object": ((), ("dst", "group_dst")),
    "scatter_object_list": ((), ("src", "group_src")),
}
#: blocking point-to-point calls -> the argument naming the peer: not checked nor
#: counted as collectives, but shown on the board (a recv from a rank that has returned
#: is a deadlock too)
POINT_TO_POINT = {"send": "dst", "recv": "src"}

#: source trees whose frames are not "the user's code" when naming where a collective was called
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torch.__file__, sys.modules["accel"].__file__ or "", functools.__file__)
)


#: futex(2)'s system call number, per machine (None: the store carries the check)
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine()) if sys.platform == "linux" else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
#: bytes of a rank's slot in the shared exchange: a generation counter (the futex word), the
#: length and the CRC-32 of what follows, and {"t": task, "c": {channel: [seq, signature,
#: previous signature]}}
SLOT_SIZE = 65536
_SLOT_HEADER = 12
#: seconds a rank sleeps on a peer's futex before it looks again (a torn read waits no longer)
_WAIT_SLICE = 0.05
#: longest signature published as it is (longer ones are published as a digest)
_SHORT_SIGNATURE = 200


def _published(signature: str) -> str:
    """A signature as the exchange carries it: itself, or a digest of a long one."""
    if len(signature) <= _SHORT_SIGNATURE:
        return signature
    return "#" + hashlib.sha1(signature.encode()).hexdigest()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Exchange:
    """The check's signatures, in a file every rank of the pool maps (one slot per rank).

    A rank writes its slot (its last two signatures per channel, for the task), then bumps
    its slot's generation and wakes whoever waits on it (futex). A peer reads the slot,
    and when what it needs is not there yet, sleeps on that generation. A signature needs
    to stay only until the next one of its channel: a peer is never more than one
    collective of a channel ahead (it would need ours to pass its next check).

    A peer may read a slot while its rank rewrites it (nothing locks the slot), and a
    rank preempted in the middle of the copy leaves it half new, half old for as long
    as it waits for a core. Such a mix can parse: cut inside a signature in both, it
    reads as another signature (``[126,"broadcast_object_list(1 objectse(float32[3])"]``
    was seen), and the peer that read it saw a mismatch no other rank saw, so it waited
    for their details until the timeout. So the header carries the CRC-32 of the data,
    written after it: a read whose data does not match it is torn, and the reader sleeps
    on the generation until the rank has finished writing.
    """

    def __init__(self, path: str, rank: int, world_size: int) -> None:
        self.rank = rank
        size = SLOT_SIZE * world_size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every rank does it, to the same size: no race
            self.memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = [ctypes.c_uint32.from_buffer(self.memory, peer * SLOT_SIZE) for peer in range(world_size)]
        self._addresses = [ctypes.addressof(word) for word in self._words]
        self._lock = threading.Lock()
        self._task = -1
        self._entries: dict[str, list[Any]] = {}
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long

    def publish(self, task: int, channel: str, seq: int, signature: str) -> None:
        value = _published(signature)
        with self._lock:
            if task != self._task:
                self._task, self._entries = task, {}
            last = self._entries.get(channel)
            self._entries[channel] = [seq, value, last[1] if last is not None and last[0] == seq - 1 else None]
            data = json.dumps({"t": task, "c": self._entries}, separators=(",", ":")).encode()
            if _SLOT_HEADER + len(data) > SLOT_SIZE:
                raise RuntimeError(
                    f"the collective check of rank {self.rank} has no room left for this task's "
                    f"{len(self._entries)} process groups; run it with check_collectives=False"
                )
            start = self.rank * SLOT_SIZE
            self.memory[start + _SLOT_HEADER : start + _SLOT_HEADER + len(data)] = data
            self.memory[start + 4 : start + 12] = len(data).to_bytes(4, "little") + zlib.crc32(data).to_bytes(
                4, "little"
            )
            word = self._words[self.rank]
            word.value = (word.value + 1) & 0xFFFFFFFF
        self._futex(self.rank, _FUTEX_WAKE, 0x7FFFFFFF, None)

    def collect(self, peers: list[int], task: int, channel: str, seq: int, timeout: float) -> dict[int, str] | None:
        """Each peer's signature of collective `seq` of `channel` (waiting for them); None at the timeout."""
        found: dict[int, str] = {}
        deadline = real_time.monotonic() + timeout
        for peer in peers:
            while True:
                generation = self._words[peer].value
                value = self._read(peer, task, channel, seq)
                if value is not None:
                    found[peer] = value
                    break
                left = deadline - real_time.monotonic()
                if left <= 0:
                    return None
                wait = min(left, _WAIT_SLICE)
                spec = _Timespec(int(wait), int((wait % 1) * 1e9))
                self._futex(peer, _FUTEX_WAIT, generation, spec)
        return found

    def _read(self, peer: int, task: int, channel: str, seq: int) -> str | None:
        start = peer * SLOT_SIZE
        header = self.memory[start + 4 : start + 12]
        size, checksum = int.from_bytes(header[:4], "little"), int.from_bytes(header[4:], "little")
        if not size or size > SLOT_SIZE - _SLOT_HEADER:
            return None
        data = self.memory[start + _SLOT_HEADER : start + _SLOT_HEADER + size]
        if zlib.crc32(data) != checksum:
            return None  # read while the peer rewrote it (torn): it bumps its generation once done
        try:
            slot = json.loads(data)
        except ValueError:  # (what the checksum lets through is whole; kept as a last guard)
            return None
        entry = slot.get("c", {}).get(channel) if slot.get("t") == task else None
        if entry is None:
            return None
        if entry[0] == seq:
            return str(entry[1])
        if entry[0] == seq + 1 and entry[2] is not None:
            return str(entry[2])
        return None

    def _futex(self, peer: int, op: int, value: int, timeout: _Timespec | None) -> None:
        self._libc.syscall(
            ctypes.c_long(_SYS_FUTEX or 0),
            ctypes.c_void_p(self._addresses[peer]),
            ctypes.c_int(op),
            ctypes.c_uint32(value),
            ctypes.byref(timeout) if timeout is not None else None,
            None,
            ctypes.c_int(0),
        )


class _Watch:
    """This process's collective bookkeeping (one per rank process)."""

    def __init__(self) -> None:
        self.rank = 0
        self._threads = threading.local()
        self.count = 0
        #: every watched call of the task, point-to-point ones included (the parent sees progress)
        self.calls = 0
        self.check = False
        self.task = 0
        self.sequences: dict[str, int] = {}
        self.board: mmap.mmap | None = None
        #: the shared memory the check's signatures go through (None: the rendezvous store)
        self.exchange: _Exchange | None = None
        self.store: Any = None
        self.prefix_store: Any = None
        #: the store the check goes through where no launcher hosts one (a process on a simulated
        #: node: its group's own store); None: the launcher's, at MASTER_ADDR:MASTER_PORT
        self.group_store: Any = None
        #: (prefix store, sequences) of ended tasks whose signatures are still in the store
        self._finished: list[tuple[Any, dict[str, int]]] = []

    @property
    def depth(self) -> int:
        """How deep the calling thread is in watched collectives (each thread calls its own)."""
        return getattr(self._threads, "depth", 0)

    @depth.setter
    def depth(self, value: int) -> None:
        self._threads.depth = value

    # -- per task ---------------------------------------------------------------------

    def begin(self, task: int, check: bool) -> None:
        if self.prefix_store is not None:
            self._finished.append((self.prefix_store, dict(self.sequences)))
        self.sequences.clear()
        self.prefix_store = None
        self.task, self.check, self.count, self.calls, self.depth = task, check, 0, 0, 0
        self._idle()

    def end(self) -> None:
        self.check = False
        self._idle()

    def forget_finished(self) -> None:
        """Delete this rank's signatures of the tasks before the one that just ended.

        The last two signatures of each group of a task stay in the store when it ends;
        once the next task has begun, every rank has ended that one, so no peer reads
        them any more. Called once this rank has answered its task, off the next one's path.
        """
        finished, self._finished = self._finished, []
        for prefix_store, sequences in finished:
            for group_name, seq in sequences.items():
                for old in range(max(1, seq - 1), seq + 1):
                    prefix_store.delete_key(f"{group_name}/{old}/{self.rank}")

    # -- per call ---------------------------------------------------------------------

    def call(self, name: str, index: dict[str, int], original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        group = _argument("group", index, args, kwargs)
        if group is c10d.GroupMember.NON_GROUP_MEMBER or _in_one_process(group):
            # torch does nothing on a rank outside the group; a group of threads, or torch's "fake" group
            # (one process standing for all its ranks), is no business of this watch
            return original(*args, **kwargs)
        self.calls += 1
        if name in POINT_TO_POINT:
            peer = _argument(POINT_TO_POINT[name], index, args, kwargs)
            self._waiting(name, [peer] if isinstance(peer, int) else _group_of(group)[0])
            try:
                return original(*args, **kwargs)
            finally:
                self._idle()
        self.count += 1
        if faults.armed():
            faults.at_collective(self.count)
        ranks, group_name = _group_of(group)
        channel = _channel(name, index, args, kwargs, group, group_name)
        seq = self.sequences.get(channel, 0) + 1
        self.sequences[channel] = seq
        self._waiting(name, ranks, channel, seq)
        try:
            if self.check and len(ranks) > 1:
                self._check(name, index, args, kwargs, ranks, channel, seq)
            return original(*args, **kwargs)
        finally:
            self._idle()

    def joint_step(self, name: str, group: Any, signature: str, step: Callable[[], T]) -> T:
        """`step()` watched as a collective of `group` named `name`: see `joint_step` (the module's)."""
        if self.depth:
            return step()  # inside a watched collective: that one is on the board
        self.depth += 1
        try:
            self.calls += 1
            ranks, group_name = _group_of(group)
            channel = _channel("barrier", {}, (), {}, group, group_name)  # no tensor: the object channel
            seq = self.sequences.get(channel, 0) + 1
            self.sequences[channel] = seq
            # Numbered as the collective it prepares (not counted itself: faults count as before).
            self._waiting(name, ranks, channel, seq, count=self.count + 1)
            try:
                if self.check and len(ranks) > 1:
                    self._check_signature(name, signature, ranks, channel, seq)
                return step()
            finally:
                self._idle()
        finally:
            self.depth -= 1

    def _check(
        self,
        name: str,
        index: dict[str, int],
        args: tuple,
        kwargs: dict,
        ranks: list[int],
        group_name: str,
        seq: int,
    ) -> None:
        self._check_signature(name, _signature(name, index, args, kwargs), ranks, group_name, seq)

    def _check_signature(self, name: str, signature: str, ranks: list[int], group_name: str, seq: int) -> None:
        key = f"{group_name}/{seq}/"
        peers = [rank for rank in ranks if rank != self.rank]
        timed_out: BaseException | None = None
        values: list[str] | None = None
        if self.exchange is not None:
            self.exchange.publish(self.task, group_name, seq, signature)
            found = self.exchange.collect(peers, self.task, group_name, seq, check_timeout())
            if found is not None:
                values = [found[rank] for rank in peers]
        else:
            store = self._store()
            store.set(key + str(self.rank), signature)
            if seq > 2:
                # Every peer has read our signature of seq-2 once it published seq-1, which we
                # have read: the key can go, so that the store does not grow with a long run.
                store.delete_key(f"{group_name}/{seq - 2}/{self.rank}")
            try:
                values = [value.decode() for value in store.multi_get([key + str(rank) for rank in peers])]
            except dist.DistStoreError as error:
                timed_out = error
        if values is None:
            who = f"{'rank' if len(peers) == 1 else 'ranks'} {ranges(peers)}"
            raise TimeoutError(
                f"rank {self.rank} waited {check_timeout():g} s for {who} to reach collective #{seq} of group "
                f"{group_name} ({name}); set ACCEL_SIM_CHECK_TIMEOUT to wait longer"
            ) from timed_out
        own = _published(signature) if self.exchange is not None else signature
        if all(value == own for value in values):
            return
        # Every rank of the group sees the mismatch: each publishes its full signature and
        # where it was called from (only now: finding it costs a stack walk), then all raise
        # the same report.
        store = self._store()
        store.set(f"{key}where/{self.rank}", f"{signature}\0{_user_location(sys._getframe(1))}")
        wheres = store.multi_get([f"{key}where/{rank}" for rank in ranks])
        calls: dict[int, tuple[str, str]] = {}
        for rank, value in zip(ranks, wheres, strict=True):
            called, _, where = value.decode().partition("\0")
            calls[rank] = (called, where)
        raise CollectiveMismatch(_mismatch_text(calls, seq, group_name, ranks), calls)

    def _store(self) -> Any:
        # A client of the rendezvous store per thread: a client waits for its peers' keys
        # holding its connection, which another thread's check must not wait behind.
        local = self._threads
        if getattr(local, "store", None) is None and self.group_store is not None:
            local.store = self.store = self.group_store.clone()  # a client of its own, as below
        if getattr(local, "store", None) is None:
            local.store = self.store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=check_timeout()),
                wait_for_workers=False,
            )
        if getattr(local, "task", None) != self.task or self.prefix_store is None:
            local.prefix_store = dist.PrefixStore(f"accel-check/{self.task}/", local.store)
            local.task = self.task
            self.prefix_store = local.prefix_store
        return local.prefix_store

    # -- the board the parent reads -----------------------------------------------------

    def _waiting(self, name: str, ranks: list[int], group_name: str = "", seq: int = 0, count: int = 0) -> None:
        if self.board is None:
            return
        # `seqs`: how many collectives this rank entered per group in this task; the board
        # keeps it when the rank goes idle, so that the parent knows, of a rank that has
        # finished, which collectives it took part in.
        board = {
            "task": self.task,
            "op": name,
            "count": count or self.count,
            "call": self.calls,
            "ranks": ranks,
            "group": group_name,
            "seq": seq,
            "seqs": self.sequences,
        }
        data = json.dumps(board).encode()[: BOARD_SIZE - 2]
        self.board[1 : 1 + len(data)] = data
        self.board[1 + len(data)] = 0
        self.board[0] = ord("W")

    def _idle(self) -> None:
        if self.board is not None:
            self.board[0] = ord("I")


_watch = _Watch()


def install(workdir: str, rank: int, store: Any = None) -> None:
    """Wrap torch.distributed's collectives in this rank process (once, at its start).

    `store`: the one the check goes through (default: the launcher's, at MASTER_ADDR:MASTER_PORT).
    """
    _watch.rank = rank
    _watch.group_store = store
    _watch.store = None
    _watch._threads = threading.local()
    if _SYS_FUTEX is not None and os.environ.get("ACCEL_SIM_CHECK_EXCHANGE", "store") == "shm":
        _watch.exchange = _Exchange(os.path.join(workdir, "check.shm"), rank, dist.get_world_size())
    path = board_path(workdir, rank)
    with open(path, "wb") as handle:
        handle.write(b"I" + b"\0" * (BOARD_SIZE - 1))
    with open(path, "r+b") as handle:
        _watch.board = mmap.mmap(handle.fileno(), BOARD_SIZE)
    for name in (*RULES, *POINT_TO_POINT):
        original = getattr(c10d, name, None)
        if original is None or hasattr(original, "__accel_original__"):
            continue
        wrapped = _wrap(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def begin_task(task: int, check: bool) -> None:
    """Start counting (and checking, when `check`) the collectives of a new task."""
    _watch.begin(task, check)


def end_task() -> None:
    """The task is over (whatever its outcome)."""
    _watch.end()


def joint_step(name: str, group: Any, signature: str, step: Callable[[], T]) -> T:
    """`step()`, which every rank of `group` must reach, watched as a collective of `group` named `name`.

    For what a collective does before it runs and all ranks must do together, such as
    creating its process groups (`dist.new_group` waits in the new group's rendezvous
    for every rank of the job, and is not a collective the wrapper sees): the board shows
    the rank waiting in `name` on `group` (numbered as the collective it prepares), so a
    step some ranks never reach is reported as a deadlock at once, and the check compares
    `signature` with what the other ranks of `group` call there. It is not counted as a
    collective (faults fire at the collective it prepares). Outside a simulated rank it
    just runs `step()`.
    """
    return _watch.joint_step(name, group, signature, step)


def forget_finished_tasks() -> None:
    """Drop the check's keys of the tasks every rank has ended (after answering a task)."""
    _watch.forget_finished()


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    index = {param: position for position, param in enumerate(inspect.signature(original).parameters)}

    def collective(*args: Any, **kwargs: Any) -> Any:
        if _watch.depth:
            return original(*args, **kwargs)
        _watch.depth += 1
        try:
            return _watch.call(name, index, original, args, kwargs)
        finally:
            _watch.depth -= 1

    # Named for the collective in stacks (faulthandler prints the code's name): a rank
    # waiting in it shows "in all_reduce", as without the wrapper.
    collective.__code__ = collective.__code__.replace(co_name=name)
    functools.update_wrapper(collective, original)
    collective.__accel_original__ = original  # type: ignore[attr-defined]  # (marks it wrapped)
    return collective


def _argument(name: str, index: dict[str, int], args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    position = index.get(name)
    return args[position] if position is not None and position < len(args) else None


#: the backend of torch's process group whose ranks are threads of one process (torch.testing's
#: `MultiThreadedTestCase`, FSDP2's `FSDPTestMultiThread`): its ranks share this process, and so this watch,
#: which speaks for one rank per process and cannot tell them apart (each would wait for the other as rank 0)
THREADED_BACKEND = "threaded"
#: groups whose ranks all live in one process: threads, or torch's "fake" group (LocalTensor tests, tracing)
IN_ONE_PROCESS = (THREADED_BACKEND, "fake")


def _in_one_process(group: Any) -> bool:
    """Whether `group` (None: the default group) has all its ranks in this process (`IN_ONE_PROCESS`)."""
    try:
        return dist.get_backend(group) in IN_ONE_PROCESS
    except (RuntimeError, ValueError):  # not initialised, or a group this rank is not in: not threads
        return False


def _group_of(group: Any) -> tuple[list[int], str]:
    if group is None or group is c10d.GroupMember.WORLD:
        return list(range(dist.get_world_size())), "default"
    return dist.get_process_group_ranks(group), str(getattr(group, "group_name", "") or id(group))


def _channel(name: str, index: dict[str, int], args: tuple, kwargs: dict, group: Any, group_name: str) -> str:
    """What numbers the collective: its group, and in a group of several backends the backend it runs on.

    A "cpu:gloo,cuda:nccl" group sends collectives on CPU tensors (and object collectives)
    to Gloo and those on GPU tensors to NCCL: two communicators, each with its own order, so
    that one thread may checkpoint over Gloo while another trains over NCCL.
    """
    try:
        devices = torch_internals.group_device_types(group)
    except (AttributeError, RuntimeError, ValueError):
        return group_name
    if len(devices) < 2:
        return group_name
    tensors = [_argument(param, index, args, kwargs) for param in RULES[name][0]]
    while tensors and isinstance(tensors[0], (list, tuple)):
        tensors = list(tensors[0])
    first = tensors[0] if tensors else None
    kind = first.device.type if isinstance(first, torch.Tensor) else torch_internals.object_collective_device(group)
    return f"{group_name}:{kind}"


def _signature(name: str, index: dict[str, int], args: tuple, kwargs: dict) -> str:
    """The call as ranks must agree on it, e.g. ``all_reduce(float32[4, 2], op=SUM)``."""
    tensors, others = RULES[name]
    parts = [_describe(_argument(param, index, args, kwargs)) for param in tensors]
    if name in _UNEVEN_ON_NCCL and _is_nccl(_argument("group", index, args, kwargs)):
        # NCCL gathers / scatters tensors of different sizes (each rank's list names them): the dtype must agree
        parts = [str(_argument(_UNEVEN_ON_NCCL[name], index, args, kwargs).dtype).removeprefix("torch.")]
    if name == "broadcast_object_list":
        parts.append(f"{len(_argument('object_list', index, args, kwargs) or ())} objects")
    for param in others:
        value = _argument(param, index, args, kwargs)
        if value is not None:
            parts.append(f"{param}={_describe(value)}")
    return f"{name}({', '.join(parts)})"


#: list collectives whose own tensor may differ in size between ranks on NCCL -> that tensor's parameter
_UNEVEN_ON_NCCL = {"all_gather": "tensor", "reduce_scatter": "output"}


def _is_nccl(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "nccl"
    except (ValueError, RuntimeError):  # not a member, or no group: the call itself will say so
        return False


def _describe(value: Any) -> str:
    if isinstance(value, dist.ReduceOp) and hasattr(value, "op"):
        # PREMUL_SUM is an op object (with its factor): its kind is what ranks must agree on
        return str(value.op).rsplit(".", 1)[-1]
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(item) for item in value) + "]"
    if value is None:
        return "None"
    text = str(value)
    # Reduce ops print as "RedOpType.SUM"; the name alone is what a user wrote.
    return text.rsplit(".", 1)[-1] if text.startswith(("RedOpType.", "ReduceOp.")) else text


def _user_location(frame: Any) -> str:
    """file:line of the innermost frame outside torch and accel (where the user called the collective)."""
    first = None
    while frame is not None:
        path = frame.f_code.co_filename
        location = f"{path}:{frame.f_lineno}"
        first = first or location
        if not path.startswith(_LIBRARY_DIRS) and not path.startswith("<"):
            return location
        frame = frame.f_back
    return first or "unknown location"


def _mismatch_text(calls: dict[int, tuple[str, str]], seq: int, group_name: str, ranks: list[int]) -> str:
    """First line: each rank's collective and where (file name:line); then the full paths."""
    group = "the default group" if group_name == "default" else f"group {group_name} (ranks {ranges(ranks)})"
    by_call: dict[tuple[str, str], list[int]] = {}
    for rank, call in calls.items():
        by_call.setdefault(call, []).append(rank)
    short, full = [], []
    for (signature, where), members in by_call.items():
        who = f"{'rank' if len(members) == 1 else 'ranks'} {ranges(members)}"
        short.append(f"{who} {signature} at {os.path.basename(where)}")
        full.append(f"  {who}: {signature} at {where}")
    return "\n".join([f"collective mismatch: {'; '.join(short)} (collective #{seq} of {group})", *full])
