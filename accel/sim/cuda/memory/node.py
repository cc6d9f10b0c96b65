"""The GPU memory of a simulated node, shared by its processes as a host's GPUs are.

On a host every process that uses GPU k takes from the same card: a process runs out of
memory where the card would, and `cudaMemGetInfo` shows what the others use. Here the
processes of one node (the same `ACCEL_SIM_NODE` folder) keep a ledger in a file of that
folder, which each maps: one slot per process, holding its pid and, per physical GPU (after
`CUDA_VISIBLE_DEVICES`), what the card sees it use (its caching allocator's reserved
segments and what it holds outside them: context, kernels, cuBLAS, NCCL). A process
writes its own slot when that changes (a new segment, `empty_cache`, a library's memory)
and reads the others' column of a GPU only when it needs a new segment there or is asked
for `mem_get_info`.

A process claims a slot by taking an fcntl lock on it, which it holds as long as it lives;
the kernel releases it when the process ends, however it ends (os._exit, SIGKILL). A slot
whose lock can be taken therefore belongs to no running process: whoever finds it clears
it, and its bytes are not counted. A lock per GPU (on bytes past the slots) makes "it fits"
and the use it allows one step, as the driver's allocation is.

Without `ACCEL_SIM_NODE` a process counts alone, as before: its allocators get no seat (None),
and the functions here do nothing for them.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import mmap
import os
import warnings
from collections.abc import Callable, Iterator, Sequence

from accel.sim.node.tree import NODE_ENV  # the folder all processes of one simulated node share

#: the ledger's file in that folder
FILE_NAME = "gpu-memory"
#: processes of a node that can use its GPUs at once (one more counts alone, with a warning)
SLOTS = 256
#: physical GPUs of a node the ledger covers (a GPU past them is counted by each process alone)
GPUS = 128
#: a slot: the owner's pid, then bytes in use per physical GPU (int64 words)
WIDTH = 1 + GPUS
_WORD = 8
_SLOT_BYTES = WIDTH * _WORD
SIZE = SLOTS * _SLOT_BYTES
#: byte SIZE + k is the lock of GPU k (POSIX locks may lie past the end of a file)
_GPU_LOCKS = SIZE


class Ledger:
    """This process's view of one node's ledger: its own slot, and the others' use."""

    def __init__(self, folder: str) -> None:
        fd = os.open(os.path.join(folder, FILE_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)  # zeros; a process racing this one sets the same size
            self._map = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            raise
        # Never closed while the process lives: closing any descriptor of the file would drop
        # every fcntl lock this process holds on it, its slot's included.
        self.fd = fd
        self.words = memoryview(self._map).cast("q")
        #: this process's slot (None: none claimed yet, or this is a forked child of its owner)
        self.slot: int | None = None
        #: bumped whenever this process's use starts afresh: seats of an earlier epoch write nothing
        self.epoch = 0

    def claim(self) -> bool:
        """Take a free slot for this process, held until it ends; False when all are taken."""
        for slot in range(SLOTS):
            if self._try_lock(slot):
                self._clear(slot)  # a dead process's leftovers, if any
                self.words[slot * WIDTH] = os.getpid()
                self.slot = slot
                return True
        return False

    def _try_lock(self, slot: int) -> bool:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _WORD, slot * _SLOT_BYTES)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EAGAIN):  # a running process holds it
                return False
            raise
        return True

    def _clear(self, slot: int) -> None:
        start = slot * _SLOT_BYTES
        self._map[start : start + _SLOT_BYTES] = bytes(_SLOT_BYTES)

    def start_afresh(self) -> None:
        """This process uses nothing on any GPU (its allocators start anew, or its test ended)."""
        self.epoch += 1
        if self.slot is not None:
            base = self.slot * WIDTH
            self._map[(base + 1) * _WORD : (base + WIDTH) * _WORD] = bytes(GPUS * _WORD)

    def release(self) -> None:
        """Give the slot back, cleared (at exit; a process killed leaves it to be found dead)."""
        if self.slot is not None:
            self._clear(self.slot)
            fcntl.lockf(self.fd, fcntl.LOCK_UN, _WORD, self.slot * _SLOT_BYTES)
            self.slot = None

    def users(self, gpu: int) -> list[tuple[int, int]]:
        """(pid, bytes) of every other running process that uses physical GPU `gpu`, in slot order."""
        found = []
        for slot, used in enumerate(self.words[1 + gpu :: WIDTH].tolist()):
            if used and slot != self.slot:
                if self._try_lock(slot):
                    # Nobody holds it: its process ended without giving it back (killed, os._exit).
                    self._clear(slot)
                    fcntl.lockf(self.fd, fcntl.LOCK_UN, _WORD, slot * _SLOT_BYTES)
                else:
                    found.append((self.words[slot * WIDTH], used))
        return found

    @contextlib.contextmanager
    def deciding(self, gpu: int) -> Iterator[None]:
        """Hold GPU `gpu` for this process: no other can take memory there meanwhile."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, _GPU_LOCKS + gpu)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, _GPU_LOCKS + gpu)


class Seat:
    """One visible GPU of this process in the ledger: where it writes what the card sees it use."""

    __slots__ = ("ledger", "gpu", "epoch")

    def __init__(self, ledger: Ledger, gpu: int) -> None:
        self.ledger = ledger
        self.gpu = gpu  # physical index
        self.epoch = ledger.epoch

    def publish(self, nbytes: int) -> None:
        """The card sees this process use `nbytes` on this GPU (one store into the shared map)."""
        ledger = self.ledger
        # An earlier epoch's allocator (a finished test's, a forked parent's) no longer speaks for the process.
        if self.epoch == ledger.epoch and ledger.slot is not None:
            ledger.words[ledger.slot * WIDTH + 1 + self.gpu] = nbytes


#: the ledgers this process opened, by the node folder's real path (one each: see `Ledger.fd`)
_ledgers: dict[str, Ledger] = {}


def _ledger() -> Ledger | None:
    """The ledger of the node this process is on, its slot claimed; None off a node (or no slot left)."""
    folder = os.environ.get(NODE_ENV)
    if not folder:
        return None
    key = os.path.realpath(folder)
    ledger = _ledgers.get(key)
    if ledger is None:
        try:
            ledger = _ledgers[key] = Ledger(folder)
        except OSError as error:
            warnings.warn(
                f"{NODE_ENV}={folder}: no ledger of the node's GPU memory ({error}); counting alone", stacklevel=2
            )
            return None
    if ledger.slot is None and not ledger.claim():
        warnings.warn(
            f"{NODE_ENV}={folder}: {SLOTS} processes use the node's GPUs already; counting alone", stacklevel=2
        )
        return None
    return ledger


def seats(physical: Sequence[int]) -> list[Seat | None]:
    """The seats of this process's visible GPUs (`physical`: the host GPU behind each), its use zero.

    None for each where the process is on no node: it counts alone, as before.
    """
    start_afresh()
    ledger = _ledger()
    return [Seat(ledger, gpu) if ledger is not None and gpu < GPUS else None for gpu in physical]


def start_afresh() -> None:
    """This process uses nothing on the node's GPUs until new seats say otherwise.

    A warm rank calls it when a test ends, before it answers: the next test starts with its
    allocators empty, and no rank of it must see this one's memory meanwhile.
    """
    for ledger in _ledgers.values():
        ledger.start_afresh()


def publish(seat: Seat | None, nbytes: int) -> None:
    """The card sees this process use `nbytes` on `seat`'s GPU."""
    if seat is not None:
        seat.publish(nbytes)


def others(seat: Seat | None) -> int:
    """Bytes the node's other processes use on `seat`'s GPU."""
    return sum(used for _, used in seat.ledger.users(seat.gpu)) if seat is not None else 0


def report(seat: Seat | None, format_size: Callable[[int], str]) -> str:
    """The other processes as CUDA's out-of-memory message lists them ("Process 123 has 2.00 GiB memory in use. ")."""
    if seat is None:
        return ""
    return "".join(
        f"Process {pid} has {format_size(used)} memory in use. " for pid, used in seat.ledger.users(seat.gpu)
    )


def deciding(seat: Seat | None) -> contextlib.AbstractContextManager[None]:
    """Hold `seat`'s GPU on the node while this process decides whether it can take memory there."""
    return seat.ledger.deciding(seat.gpu) if seat is not None else contextlib.nullcontext()


def _forked_child() -> None:
    # The child holds none of its parent's locks, and its copy of the parent's allocators is not
    # what the card sees it use: it writes nothing until it claims a slot of its own.
    for ledger in _ledgers.values():
        ledger.slot = None
        ledger.epoch += 1


def _at_exit() -> None:
    for ledger in _ledgers.values():
        ledger.release()


os.register_at_fork(after_in_child=_forked_child)
atexit.register(_at_exit)
