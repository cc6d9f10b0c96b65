"""What went wrong in which rank: the errors `accel.sim.launch` raises and their text.

A failed launch names every failed rank with its own traceback (or exit code, signal
name, or live stack at a timeout), and shows where the ranks that were still running
waited. A rank that died brings the last lines it wrote to stderr, and a hint where
the cause is a known one (a script without a `__main__` guard). Every line of a rank's
block is prefixed with ``[rank N]`` so that a report of four interleaved ranks stays
readable and greppable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: kinds of RankFailure: raised an exception, exited without returning, killed by a
#: signal, still running at the timeout, stopped by the simulator because another
#: rank had failed first (listed apart from the failures: they are victims, not causes),
#: or waiting in a collective that could no longer complete (its peers had returned)
KINDS = ("exception", "exit", "signal", "timeout", "stopped", "deadlock")


@dataclasses.dataclass
class RankFailure:
    """How one rank failed; `kind` is one of `KINDS`."""

    rank: int
    kind: str
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    exception: BaseException | None = None
    exitcode: int | None = None
    signal_name: str | None = None
    stack: str = ""
    #: the last lines the rank wrote to stderr (a rank that died)
    stderr: str = ""
    #: a likely cause and what to do about it
    hint: str = ""
    #: which collective the rank was waiting in, and where (a deadlocked or stopped rank)
    waiting: str = ""

    def headline(self) -> str:
        """One line saying what happened to this rank."""
        if self.kind == "exception":
            short = (self.exc_type or "Exception").rsplit(".", 1)[-1]
            first_line = self.message.strip().splitlines()[0] if self.message.strip() else ""
            return f"{short}: {first_line}" if first_line else short
        if self.kind == "exit":
            return f"exited with code {self.exitcode} before returning"
        if self.kind == "signal":
            return f"killed by signal {self.signal_name}"
        if self.kind == "timeout":
            return "still running at the timeout; its stack at that moment:"
        if self.kind == "deadlock":
            return f"{self.waiting}, which can no longer complete; its stack:"
        if self.waiting:
            return f"still running after another rank had failed (then stopped): it {self.waiting}; its stack:"
        return "still running after another rank had failed (then stopped); it was here:"

    def details(self) -> str:
        """The rank's own traceback, or its live stack where that is all there is."""
        if self.kind == "exception":
            # Without a single frame of its own, the traceback would only repeat the headline.
            return self.traceback if 'File "' in self.traceback else ""
        return self.stack

    def format(self) -> str:
        """The headline and details, each line prefixed with ``[rank N]``."""
        lines = [self.headline()]
        details = self.details().rstrip("\n")
        if details:
            lines.extend(details.splitlines())
        if self.stderr:
            lines.append("its last lines on stderr:")
            lines.extend("    " + line for line in self.stderr.splitlines())
        if self.hint:
            lines.append(f"hint: {self.hint}")
        prefix = f"[rank {self.rank}] "
        return "\n".join(prefix + line for line in lines)


class CollectiveMismatch(RuntimeError):
    """Ranks of a process group called different collectives (raised in each of them by the simulator).

    `calls` maps each rank of the group to (its collective with shapes and dtypes, the
    file:line of the user's code that called it).
    """

    def __init__(self, message: str, calls: dict[int, tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.calls = dict(calls or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.calls))


class DistributedFailure(RuntimeError):
    """One or more ranks of a simulated launch failed.

    Attributes:
        failures: rank -> RankFailure, every rank that failed (exception, exit,
            signal, or timeout).
        stopped: rank -> RankFailure (kind "stopped"), ranks still running after
            another rank failed, with the stack where they waited.
        world_size, device: what was launched.
    """

    def __init__(
        self,
        failures: dict[int, RankFailure],
        stopped: dict[int, RankFailure] | None = None,
        world_size: int | None = None,
        device: str | None = None,
        summary: str | None = None,
    ) -> None:
        # Kept in the order given: the launcher puts the likely cause first.
        self.failures = dict(failures)
        self.stopped = dict(sorted((stopped or {}).items()))
        self.world_size = world_size
        self.device = device
        self.summary = summary or self._default_summary()
        super().__init__(self.summary)

    def _default_summary(self) -> str:
        ranks = ", ".join(str(rank) for rank in sorted(self.failures))
        where = f" of {self.world_size}" if self.world_size else ""
        on = f" (device {self.device!r})" if self.device else ""
        noun = "rank" if len(self.failures) == 1 else "ranks"
        return f"{noun} {ranks}{where} failed{on}"

    def first(self) -> RankFailure:
        """The failure most likely to be the cause (the launcher orders them so)."""
        return next(iter(self.failures.values()), None) or next(iter(self.stopped.values()))

    def report(self) -> str:
        """The full multi-rank report: every failure, then where the stopped ranks waited."""
        blocks = [self.summary + ":"]
        blocks.extend(failure.format() for failure in self.failures.values())
        blocks.extend(failure.format() for failure in self.stopped.values())
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return self.report()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.stopped, self.world_size, self.device, self.summary))


class DistributedTimeout(DistributedFailure):
    """A simulated launch did not finish in time; `failures` holds each live rank's stack."""


class DistributedDeadlock(DistributedFailure):
    """Ranks waited in collectives that could no longer complete: their peers had returned.

    `failures` holds each waiting rank (kind "deadlock") with the collective it waited
    in, where, and its stack.
    """
