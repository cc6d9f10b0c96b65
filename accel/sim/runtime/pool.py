"""Warm rank pools, on the parent's side: start N ranks once, run many tasks on them.

Starting a rank means importing torch (seconds) and creating a process group; running
a trivial test on a warm rank takes milliseconds. So ranks are forked from a fork
server that imported torch and accel once (`accel.sim.runtime.forking`), kept per (world size,
device) by `accel.sim.runtime.manager`, and reused until a task leaves them in doubt (a
failure, a death, a destroyed process group), when the pool is thrown away and the
next task gets fresh ranks.

A `RankPool` runs one task at a time: it sends the task to every rank, waits for the
answers, relays what the ranks print (prefixed with their rank), and decides what
happened to the ranks that did not answer: after the first failure the others get a
short grace to finish or fail on their own; at the timeout (or after the grace) their
Python stacks are taken with SIGUSR1 and the whole pool is killed. Ranks that still
wait in a collective once a peer of that collective has finished are a deadlock: they
are stopped within about a second (`DEADLOCK_SETTLE`), not at the timeout, and the
report says which collective each waits in. A rank that dies brings the last lines it
wrote to stderr into the report.

A pool may run only some ranks of a larger world (`stand_in`, `accel.sim.runtime.stand_in`):
process k is then rank `stand_in.ranks[k]` of that world, shown as such in the output, and
never waits for a peer (no deadlock watch).

The messages exchanged with the ranks are the types of `accel.sim.runtime.messages`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from accel.sim import real_time
from accel.sim.diagnoses import deadlock, guard, stacks
from accel.sim.diagnoses.failures import DistributedFailure, RankFailure
from accel.sim.runtime import coverage_support, forking, output
from accel.sim.runtime.messages import ExceptionReport, Port, Ready, RunTask, StartError, Status, Stop, TaskDone

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
#: lines of a dead rank's stderr quoted in the report
STDERR_TAIL_LINES = 15


@dataclasses.dataclass
class RankOutcome:
    """What one rank made of one task: `status` OK (with `value`, serialised) or a `failure`."""

    rank: int
    status: Status
    value: bytes | None = None
    failure: RankFailure | None = None
    pg_ok: bool = False
    #: order in which the parent learnt the outcome (earlier failures are likelier causes)
    seq: int = 0

    def __repr__(self) -> str:
        return f"RankOutcome(rank={self.rank}, status={self.status.value!r})"


class RankPool:
    """N rank processes of one (world_size, device), ready to run tasks one at a time."""

    def __init__(
        self,
        world_size: int,
        device: str,
        real_device: bool = False,
        env: dict[str, str] | None = None,
        stand_in: Any = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        #: how many rank processes the pool runs
        self.world_size = world_size
        #: None, or the `accel.sim.runtime.stand_in.StandIn` whose ranks (of a larger world) these processes are:
        #: process k is rank `stand_in.ranks[k]`, its collectives complete without the others
        self.stand_in = stand_in
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
        #: what the ranks print goes live to our stdout/stderr (settings: `accel.sim.runtime.output.configure`)
        self._relay = output.OutputRelay(world_size, names=stand_in.ranks if stand_in is not None else None)
        self._stack_offsets: list[int] = [0] * world_size
        #: size of each rank's stderr file when the current task began
        self._err_offsets: list[int] = [0] * world_size

    # -- start and stop --------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the ranks and wait until each has its process group."""
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
                identity = self.stand_in.rank_config(rank) if self.stand_in is not None else {}
                proc, parent_end = forking.start_rank({**config, "rank": rank, **identity})
                self._procs.append(proc)
                self._conns.append(parent_end)
            self._outputs = [
                [self._open_output(rank, "out"), self._open_output(rank, "err")] for rank in range(self.world_size)
            ]
            self._handshake(real_time.monotonic() + timeout)
        except BaseException:
            self.kill()
            raise
        self.healthy = True

    def _open_output(self, rank: int, suffix: str) -> Any:
        path = os.path.join(self._workdir, f"rank{rank}.{suffix}")
        # The rank creates it; create it here too so that reading never races the rank.
        with open(path, "ab"):
            pass
        return open(path, "rb")  # kept open to read incrementally

    def _handshake(self, deadline: float) -> None:
        """Pass rank 0's rendezvous port to the others, then wait until every rank is ready.

        Every rank is watched all along: one that dies or fails while the others wait
        for it in the rendezvous fails the start at once, not at the deadline.
        """
        ready: set[int] = set()
        while len(ready) < self.world_size:
            remaining = deadline - real_time.monotonic()
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
                        message = conn.recv()
                    except EOFError:
                        continue  # it died: its sentinel tells how
                    if isinstance(message, Port):
                        for other in self._conns[1:]:
                            other.send(message)
                    elif isinstance(message, Ready):
                        ready.add(rank)
                    elif isinstance(message, StartError):
                        self._start_failed({rank: _exception_failure(rank, message.error)}, "error")
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in signalled:
                    # What it said before dying (its set-up error) may still be in the pipe,
                    # behind the message read above.
                    with contextlib.suppress(EOFError, OSError):
                        while self._conns[rank].poll():
                            message = self._conns[rank].recv()
                            if isinstance(message, StartError):
                                self._start_failed({rank: _exception_failure(rank, message.error)}, "error")
                    failure = self._death(rank)
                    if not failure.stderr:  # it died before its output was captured: while importing __main__?
                        failure.hint = guard.main_guard_hint()
                    self._start_failed({rank: failure}, "death")

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
        stop = pickle.dumps(Stop(), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            with contextlib.suppress(OSError):  # that rank is gone already
                conn.send_bytes(stop)
        deadline = real_time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - real_time.monotonic()))
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
            with contextlib.suppress(ValueError):  # still running after 5 s: its sentinel stays open
                proc.close()
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

    def run(
        self,
        payload: bytes,
        timeout: float | None,
        grace: float = FAILURE_GRACE,
        check_collectives: bool = True,
        faults: tuple = (),
    ) -> list[RankOutcome]:
        """Run a serialised call on every rank; one outcome per rank, in rank order.

        Never raises for what happens in ranks: failures, deaths, deadlocks and timeouts
        are outcomes. `timeout` None waits as long as ranks make progress (a deadlock
        still ends the task). `check_collectives` checks every collective across ranks
        before it runs; `faults` (`accel.sim.diagnoses.faults.Fault`) are injected in their ranks.
        The pool is killed when a rank did not answer; the caller decides whether it may
        be reused otherwise.
        """
        if not self.healthy:
            raise RuntimeError("this rank pool is not running; start a new one")
        self._send_task(payload, check_collectives, faults)
        deadline = real_time.monotonic() + timeout if timeout is not None else float("inf")
        outcomes, stuck, stop_at = self._await_outcomes(deadline, grace)
        left = [rank for rank in range(self.world_size) if rank not in outcomes]
        if left:
            self._stop_unanswered(left, outcomes, stuck, stop_at, deadline)
        self.relay(final=True)  # before a kill: what the ranks printed last often explains it
        if left or any(outcome.status in (Status.EXIT, Status.SIGNAL) for outcome in outcomes.values()):
            self.kill()
        return [outcomes[rank] for rank in range(self.world_size)]

    def _send_task(self, payload: bytes, check_collectives: bool, faults: tuple) -> None:
        """Send the next task to every rank, noting where each rank's stderr stood when it began."""
        self.tasks_run += 1
        task = RunTask(payload, os.getcwd(), list(sys.path), self.tasks_run, check_collectives, tuple(faults))
        message = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
        self._err_offsets = [self._output_size(rank, "err") for rank in range(self.world_size)]
        for conn in self._conns:
            conn.send_bytes(message)

    def _await_outcomes(
        self, deadline: float, grace: float
    ) -> tuple[dict[int, RankOutcome], dict[int, dict[str, Any]], float | None]:
        """The outcomes of the ranks that answered, relaying their output meanwhile; then the ranks
        found stuck in a deadlock, and when the others were to be stopped after a first failure
        (None: no rank failed). Waits until every rank answered, the deadline passed, the grace
        after a failure ran out, or ranks are stuck."""
        outcomes: dict[int, RankOutcome] = {}
        stop_at: float | None = None
        watch = deadlock.Watch(self.world_size, self._workdir, self.tasks_run)
        stuck: dict[int, dict[str, Any]] = {}
        while len(outcomes) < self.world_size:
            limit = deadline if stop_at is None else min(deadline, stop_at)
            remaining = limit - real_time.monotonic()
            if remaining <= 0:
                break
            pending = [rank for rank in range(self.world_size) if rank not in outcomes]
            waitables: list[Any] = [self._conns[rank] for rank in pending] + [
                self._procs[rank].sentinel for rank in pending
            ]
            ready = multiprocessing.connection.wait(waitables, timeout=min(remaining, RELAY_INTERVAL))
            if not ready:
                self.relay()
                # ranks standing in for others never wait for a peer (and the boards name global ranks)
                stuck = watch.stuck(pending, finished=set(outcomes)) if self.stand_in is None else {}
                if stuck:
                    break
                continue
            for rank in pending:
                if self._conns[rank] in ready or self._procs[rank].sentinel in ready:
                    outcomes[rank] = self._collect(rank)
                    outcomes[rank].seq = len(outcomes)
                    if outcomes[rank].status != Status.OK and stop_at is None:
                        stop_at = real_time.monotonic() + grace
        return outcomes, stuck, stop_at

    def _stop_unanswered(
        self,
        left: list[int],
        outcomes: dict[int, RankOutcome],
        stuck: dict[int, dict[str, Any]],
        stop_at: float | None,
        deadline: float,
    ) -> None:
        """Add the outcomes of the ranks `left` that never answered, each with its stack: deadlocked,
        stopped (after another rank failed, or stuck beside a failure) or timed out."""
        if stuck:
            kind = Status.DEADLOCK if stop_at is None else Status.STOPPED
        else:
            kind = Status.STOPPED if stop_at is not None and real_time.monotonic() < deadline else Status.TIMEOUT
        dumped = self._dump_stacks(left)
        for rank in left:
            failure = RankFailure(rank, kind.value, stack=dumped[rank])
            if rank in stuck:
                failure.waiting = deadlock.describe_wait(stuck[rank], dumped[rank])
            outcomes[rank] = RankOutcome(rank, kind, failure=failure, seq=len(outcomes) + 1)

    def _collect(self, rank: int) -> RankOutcome:
        conn = self._conns[rank]
        if conn.poll():
            try:
                done = pickle.loads(conn.recv_bytes())
            except EOFError:
                done = None
            if isinstance(done, TaskDone):
                return _outcome_from_report(rank, done)
        failure = self._death(rank)
        return RankOutcome(rank, Status(failure.kind), failure=failure)

    def _death(self, rank: int) -> RankFailure:
        proc = self._procs[rank]
        proc.join(5.0)
        code = proc.exitcode
        crash = self._read_stack(rank)
        stderr = self._stderr_tail(rank)
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return RankFailure(rank, "signal", exitcode=code, signal_name=name, stack=crash, stderr=stderr)
        return RankFailure(rank, "exit", exitcode=code, stack=crash, stderr=stderr)

    def _output_size(self, rank: int, suffix: str) -> int:
        try:
            return os.path.getsize(os.path.join(self._workdir, f"rank{rank}.{suffix}"))
        except OSError:
            return 0

    def _stderr_tail(self, rank: int) -> str:
        """The last lines the rank wrote to stderr during this task (or its start)."""
        start = self._err_offsets[rank]
        try:
            with open(os.path.join(self._workdir, f"rank{rank}.err"), "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(start, size - 16384))
                data = handle.read()
        except OSError:
            return ""
        lines = data.decode(errors="replace").rstrip("\n").splitlines()
        return "\n".join(lines[-STDERR_TAIL_LINES:])

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
        deadline = real_time.monotonic() + 2.0
        last = dict(sizes)
        while asked and real_time.monotonic() < deadline:
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
        """Copy what the ranks printed since the last call to our stdout/stderr (see `accel.sim.runtime.output`)."""
        for rank, files in enumerate(self._outputs):
            for index, handle in enumerate(files):
                data = handle.read()
                if data or final:
                    self._relay.feed(rank, index, data, final)


#: variables that describe the parent's current moment, not an environment to start from
_TRANSIENT_VARIABLES = ("PYTEST_CURRENT_TEST",)


def _rank_environment(env: Any) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in _TRANSIENT_VARIABLES}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # Not (yet) the leader of its own group: kill the process alone.
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)


def _exception_failure(rank: int, report: ExceptionReport) -> RankFailure:
    exception = None
    if report.exception is not None:
        try:
            exception = pickle.loads(report.exception)
        except Exception:  # a class the parent cannot import: the text is kept
            exception = None
    return RankFailure(
        rank,
        "exception",
        exc_type=report.exc_type,
        message=report.message,
        traceback=report.traceback,
        exception=exception,
    )


def _outcome_from_report(rank: int, done: TaskDone) -> RankOutcome:
    if done.status == Status.OK:
        return RankOutcome(rank, Status.OK, value=done.value, pg_ok=done.pg_ok)
    if done.status == Status.EXIT:
        if not done.exit_code:  # sys.exit(0) / sys.exit(): a normal end, with no value
            return RankOutcome(rank, Status.OK, value=None, pg_ok=False)
        return RankOutcome(rank, Status.EXIT, failure=RankFailure(rank, "exit", exitcode=done.exit_code))
    if done.error is None:
        raise TypeError(f"rank {rank} reported {done.status} without saying what it raised")
    return RankOutcome(rank, Status.EXCEPTION, failure=_exception_failure(rank, done.error), pg_ok=done.pg_ok)
