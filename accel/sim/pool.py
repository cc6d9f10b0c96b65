"""Warm rank pools, on the parent's side: start N ranks once, run many tasks on them.

Starting a rank means importing torch (seconds) and creating a process group; running
a trivial test on a warm rank takes milliseconds. So ranks are forked from a fork
server that imported torch and accel once (`accel.sim.forking`), kept per (world size,
device) by `accel.sim.manager`, and reused until a task leaves them in doubt (a
failure, a death, a destroyed process group), when the pool is thrown away and the
next task gets fresh ranks.

A `RankPool` runs one task at a time: it sends the task to every rank, waits for the
answers, relays what the ranks print (prefixed with their rank), and decides what
happened to the ranks that did not answer: after the first failure the others get a
short grace to finish or fail on their own; at the timeout (or after the grace) their
Python stacks are taken with SIGUSR1 and the whole pool is killed.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from accel.sim import coverage_support, entry, forking, stacks
from accel.sim.failures import DistributedFailure, RankFailure

#: after the first failed rank, how long the others get to finish before being stopped
FAILURE_GRACE = 1.0
#: how often the parent relays what ranks printed while it waits
RELAY_INTERVAL = 0.05
#: how long a pool may take to start (the first one imports torch in the fork server)
START_TIMEOUT = float(os.environ.get("ACCEL_SIM_START_TIMEOUT", "120"))
#: idle warm ranks kept per process (least recently used pools are closed beyond it);
#: parametrized tests cycle through their configurations, so the usual grid
#: (world sizes 2 and 4 on cpu, cuda and xla: 18 ranks) must fit, or every test would
#: evict the pool the next one needs. A warm rank holds about 10-50 MB of its own.
MAX_WARM_RANKS = int(os.environ.get("ACCEL_SIM_MAX_WARM_RANKS", "32"))


class RankOutcome:
    """What one rank made of one task: `status` "ok" (with `value`, serialised) or a `failure`."""

    __slots__ = ("rank", "status", "value", "failure", "pg_ok", "seq")

    def __init__(
        self,
        rank: int,
        status: str,
        value: bytes | None = None,
        failure: RankFailure | None = None,
        pg_ok: bool = False,
    ) -> None:
        self.rank, self.status, self.value, self.failure, self.pg_ok = rank, status, value, failure, pg_ok
        #: order in which the parent learnt the outcome (earlier failures are likelier causes)
        self.seq = 0

    def __repr__(self) -> str:
        return f"RankOutcome(rank={self.rank}, status={self.status!r})"


class RankPool:
    """N rank processes of one (world_size, device), ready to run tasks one at a time."""

    def __init__(
        self, world_size: int, device: str, real_device: bool = False, env: dict[str, str] | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.device = device
        self.real_device = real_device
        #: the environment every task starts from (default: ours when the pool starts)
        self.env = env
        self.healthy = False
        self.tasks_run = 0
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._workdir = tempfile.mkdtemp(prefix=f"accel-sim-{device}{world_size}-")
        self._outputs: list[list[Any]] = []
        self._partial: dict[tuple[int, int], bytes] = {}
        self._stack_offsets: list[int] = [0] * world_size

    # -- start and stop --------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the ranks and wait until each has its process group."""
        ctx = forking.context()
        config = {
            "world_size": self.world_size,
            "device": self.device,
            "real_device": self.real_device,
            "env": _rank_environment(self.env if self.env is not None else os.environ),
            "workdir": self._workdir,
            "coverage": coverage_support.parent_settings(),
            "num_threads": max(1, (os.cpu_count() or 1) // self.world_size),
        }
        try:
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=entry.rank_main, args=({**config, "rank": rank}, child_end), name=f"accel-sim-rank{rank}"
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            self._outputs = [
                [self._open_output(rank, "out"), self._open_output(rank, "err")] for rank in range(self.world_size)
            ]
            self._handshake(time.monotonic() + timeout)
        except BaseException:
            self.kill()
            raise
        self.healthy = True

    def _open_output(self, rank: int, suffix: str) -> Any:
        path = os.path.join(self._workdir, f"rank{rank}.{suffix}")
        # The rank creates it; create it here too so that reading never races the rank.
        with open(path, "ab"):
            pass
        return open(path, "rb")  # noqa: SIM115  (kept open to read incrementally)

    def _handshake(self, deadline: float) -> None:
        """Pass rank 0's rendezvous port to the others, then wait until every rank is ready.

        Every rank is watched all along: one that dies or fails while the others wait
        for it in the rendezvous fails the start at once, not at the deadline.
        """
        ready: set[int] = set()
        while len(ready) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = [rank for rank in range(self.world_size) if rank not in ready]
                dumped = self._dump_stacks(waiting)
                self._start_failed(
                    {rank: RankFailure(rank, "timeout", stack=dumped[rank]) for rank in waiting}, "timeout"
                )
            conns = [self._conns[rank] for rank in range(self.world_size) if rank not in ready]
            signalled = multiprocessing.connection.wait(
                conns + [proc.sentinel for proc in self._procs], timeout=min(remaining, RELAY_INTERVAL)
            )
            self.relay()
            for rank in range(self.world_size):
                conn = self._conns[rank]
                if rank not in ready and (conn in signalled or conn.poll()):
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        continue  # it died: its sentinel tells how
                    if kind == "port":
                        for other in self._conns[1:]:
                            other.send(("port", value))
                    elif kind == "ready":
                        ready.add(rank)
                    elif kind == "error":
                        self._start_failed({rank: _exception_failure(rank, value)}, "error")
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in signalled:
                    self._start_failed({rank: self._death(rank)}, "death")

    def _start_failed(self, failures: dict[int, RankFailure], why: str) -> None:
        self.relay(final=True)
        self.kill()
        raise DistributedFailure(
            failures,
            world_size=self.world_size,
            device=self.device,
            summary=f"simulated ranks (world_size={self.world_size}, device={self.device!r}) failed to start ({why})",
        )

    def close(self) -> None:
        """Ask the ranks to exit, then make sure they did."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass  # that rank is gone already
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank (and whatever it started) now, and clean up."""
        self.healthy = False
        for proc in self._procs:
            if proc.pid is not None and proc.exitcode is None:
                _kill_group(proc.pid)
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        for files in self._outputs:
            for handle in files:
                handle.close()
        self._procs, self._conns, self._outputs = [], [], []
        shutil.rmtree(self._workdir, ignore_errors=True)

    def alive(self) -> bool:
        """Whether every rank process is still running."""
        return bool(self._procs) and all(proc.exitcode is None for proc in self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [proc.pid for proc in self._procs]

    # -- running a task --------------------------------------------------------------------

    def run(self, payload: bytes, timeout: float, grace: float = FAILURE_GRACE) -> list[RankOutcome]:
        """Run a serialised call on every rank; one outcome per rank, in rank order.

        Never raises for what happens in ranks: failures, deaths and timeouts are
        outcomes. The pool is killed when a rank did not answer; the caller decides
        whether it may be reused otherwise.
        """
        if not self.healthy:
            raise RuntimeError("this rank pool is not running; start a new one")
        self.tasks_run += 1
        message = pickle.dumps(("run", payload, os.getcwd(), list(sys.path)), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(message)
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout
        stop_at: float | None = None
        while len(outcomes) < self.world_size:
            limit = deadline if stop_at is None else min(deadline, stop_at)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            pending = [rank for rank in range(self.world_size) if rank not in outcomes]
            waitables: list[Any] = [self._conns[rank] for rank in pending] + [
                self._procs[rank].sentinel for rank in pending
            ]
            ready = multiprocessing.connection.wait(waitables, timeout=min(remaining, RELAY_INTERVAL))
            if not ready:
                self.relay()
                continue
            for rank in pending:
                if self._conns[rank] in ready or self._procs[rank].sentinel in ready:
                    outcomes[rank] = self._collect(rank)
                    outcomes[rank].seq = len(outcomes)
                    if outcomes[rank].status != "ok" and stop_at is None:
                        stop_at = time.monotonic() + grace
        left = [rank for rank in range(self.world_size) if rank not in outcomes]
        if left:
            kind = "stopped" if stop_at is not None and time.monotonic() < deadline else "timeout"
            dumped = self._dump_stacks(left)
            for rank in left:
                outcomes[rank] = RankOutcome(rank, kind, failure=RankFailure(rank, kind, stack=dumped[rank]))
                outcomes[rank].seq = len(outcomes)
        self.relay(final=True)  # before a kill: what the ranks printed last often explains it
        if left or any(outcome.status in ("exit", "signal") for outcome in outcomes.values()):
            self.kill()
        return [outcomes[rank] for rank in range(self.world_size)]

    def _collect(self, rank: int) -> RankOutcome:
        conn = self._conns[rank]
        if conn.poll():
            try:
                _, report = pickle.loads(conn.recv_bytes())
            except EOFError:
                report = None
            if report is not None:
                return _outcome_from_report(rank, report)
        return RankOutcome(rank, *_status_of(self._death(rank)))

    def _death(self, rank: int) -> RankFailure:
        proc = self._procs[rank]
        proc.join(5.0)
        code = proc.exitcode
        crash = self._read_stack(rank)
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return RankFailure(rank, "signal", exitcode=code, signal_name=name, stack=crash)
        return RankFailure(rank, "exit", exitcode=code, stack=crash)

    # -- stacks and output -----------------------------------------------------------------

    def _read_stack(self, rank: int) -> str:
        path = os.path.join(self._workdir, f"rank{rank}.stack")
        try:
            with open(path, "rb") as handle:
                handle.seek(self._stack_offsets[rank])
                data = handle.read()
        except OSError:
            return ""
        self._stack_offsets[rank] += len(data)
        return stacks.trim_stack(data.decode(errors="replace"))

    def _dump_stacks(self, ranks: Iterable[int]) -> dict[int, str]:
        """Each live rank's Python stack, every thread, at this moment (SIGUSR1 -> faulthandler)."""
        ranks = list(ranks)
        sizes = {rank: self._stack_size(rank) for rank in ranks}
        asked = []
        for rank in ranks:
            proc = self._procs[rank]
            if proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    asked.append(rank)
                except ProcessLookupError:
                    pass  # it died meanwhile; its crash dump (if any) is read below
        # faulthandler writes from the signal handler itself; wait until each file has
        # grown and stopped growing.
        deadline = time.monotonic() + 2.0
        last = dict(sizes)
        while asked and time.monotonic() < deadline:
            time.sleep(0.02)
            now = {rank: self._stack_size(rank) for rank in asked}
            if all(now[rank] > sizes[rank] and now[rank] == last[rank] for rank in asked):
                break
            last.update(now)
        return {rank: self._read_stack(rank) or "(no stack: the rank did not answer SIGUSR1)" for rank in ranks}

    def _stack_size(self, rank: int) -> int:
        try:
            return os.path.getsize(os.path.join(self._workdir, f"rank{rank}.stack"))
        except OSError:
            return 0

    def relay(self, final: bool = False) -> None:
        """Copy what the ranks printed to our stdout/stderr, each line prefixed with its rank."""
        for rank, files in enumerate(self._outputs):
            for index, (handle, stream) in enumerate(zip(files, (sys.stdout, sys.stderr))):
                data = self._partial.pop((rank, index), b"") + handle.read()
                if not data:
                    continue
                lines = data.split(b"\n")
                rest = lines.pop()
                if rest and not final:
                    self._partial[(rank, index)] = rest
                elif rest:
                    lines.append(rest)
                if lines and stream is not None:
                    prefix = f"[rank {rank}] "
                    stream.write("".join(prefix + line.decode(errors="replace") + "\n" for line in lines))
                    stream.flush()


#: variables that describe the parent's current moment, not an environment to start from
_TRANSIENT_VARIABLES = ("PYTEST_CURRENT_TEST",)


def _rank_environment(env: Any) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in _TRANSIENT_VARIABLES}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # Not (yet) the leader of its own group: kill the process alone.
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone


def _exception_failure(rank: int, report: dict[str, Any]) -> RankFailure:
    exception = None
    if report.get("exception") is not None:
        try:
            exception = pickle.loads(report["exception"])
        except Exception:  # noqa: BLE001  (a class the parent cannot import: the text is kept)
            exception = None
    return RankFailure(
        rank,
        "exception",
        exc_type=report["exc_type"],
        message=report["message"],
        traceback=report["traceback"],
        exception=exception,
    )


def _outcome_from_report(rank: int, report: dict[str, Any]) -> RankOutcome:
    status = report["status"]
    pg_ok = report.get("pg_ok", False)
    if status == "ok":
        return RankOutcome(rank, "ok", value=report["value"], pg_ok=pg_ok)
    if status == "exit":
        code = report["code"]
        if code == 0:  # sys.exit(0) / sys.exit(): a normal end, with no value
            return RankOutcome(rank, "ok", value=None, pg_ok=False)
        return RankOutcome(rank, "exit", failure=RankFailure(rank, "exit", exitcode=code))
    return RankOutcome(rank, "exception", failure=_exception_failure(rank, report), pg_ok=pg_ok)


def _status_of(failure: RankFailure) -> tuple[str, None, RankFailure]:
    return failure.kind, None, failure
