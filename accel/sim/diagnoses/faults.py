"""Injected faults: kill, raise in or stall one simulated rank, at a collective or a marked point.

A training loop that must survive a lost rank, an exception or a straggler can be
tested by injecting that fault::

    from accel.sim import Fault, launch

    launch(train, world_size=4, faults=[Fault("kill", rank=1, collective=3)])

    @distributed_test(world_size=4, faults=["stall:rank=2:point=after_save:seconds=2"])
    def test_survives_a_straggler(rank): ...

A fault fires in its rank just before that rank's N-th collective of the task (counted
from 1 over every process group; a collective that calls others counts once; send and
recv are not collectives and do not count), or when
the code reaches ``accel.sim.fault_point(name)``, a no-op outside the simulator.
Actions: "kill" (SIGKILL: the rank dies as on a lost node), "raise" (`InjectedFault`),
"stall" (sleep `seconds`, then go on).

This module is free of torch: the parent builds and checks faults, the ranks fire them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

ACTIONS = ("kill", "raise", "stall")
#: seconds a "stall" fault sleeps when it does not say
DEFAULT_STALL_SECONDS = 5.0


class InjectedFault(RuntimeError):
    """Raised in a rank by a "raise" fault."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: `action` ("kill", "raise", "stall") in `rank`, at its `collective`-th collective or at `point`."""

    action: str
    rank: int
    collective: int | None = None
    point: str | None = None
    seconds: float = DEFAULT_STALL_SECONDS

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; choose one of {', '.join(ACTIONS)}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"a fault's rank must be an int >= 0, got {self.rank!r}")
        if (self.collective is None) == (self.point is None):
            raise ValueError(
                "a fault fires at a collective or at a point, exactly one of them: got "
                f"collective={self.collective!r}, point={self.point!r}"
            )
        if self.collective is not None and (not isinstance(self.collective, int) or self.collective < 1):
            raise ValueError(f"a fault's collective counts from 1, got {self.collective!r}")
        if self.point is not None and (not isinstance(self.point, str) or not self.point or ":" in self.point):
            raise ValueError(f"a fault's point must be a non-empty name without ':', got {self.point!r}")
        if self.seconds < 0:
            raise ValueError(f"a stall lasts 0 seconds or more, got {self.seconds!r}")

    def describe(self) -> str:
        """The fault in the words of its spec, e.g. "kill:rank=1:collective=3"."""
        where = f"collective={self.collective}" if self.collective is not None else f"point={self.point}"
        # repr: the shortest text that reads back as the same float
        extra = f":seconds={repr(float(self.seconds)).removesuffix('.0')}" if self.action == "stall" else ""
        return f"{self.action}:rank={self.rank}:{where}{extra}"


def parse_fault(spec: str) -> Fault:
    """A `Fault` from its string form, as ``accel launch --simulate --fault SPEC`` takes it.

    Grammar: ``ACTION:rank=R:collective=N`` or ``ACTION:rank=R:point=NAME``, where
    ACTION is ``kill``, ``raise`` or ``stall``; a stall may add ``:seconds=S`` (default
    5). Fields after the action come in any order, each once. Examples::

        kill:rank=1:collective=3          SIGKILL rank 1 just before its 3rd collective
        raise:rank=0:point=after_save     raise InjectedFault when rank 0 reaches
                                          accel.sim.fault_point("after_save")
        stall:rank=2:collective=5:seconds=3

    Raises ValueError naming what is wrong.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a fault spec is a string, got {spec!r}")
    action, *fields = spec.strip().split(":")
    values: dict[str, str] = {}
    for field in fields:
        name, sep, value = field.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"fault spec {spec!r}: {field!r} is not NAME=VALUE")
        if name in values:
            raise ValueError(f"fault spec {spec!r}: {name} is given twice")
        values[name] = value
    unknown = set(values) - {"rank", "collective", "point", "seconds"}
    if unknown:
        raise ValueError(
            f"fault spec {spec!r}: unknown field(s) {', '.join(sorted(unknown))}; see accel.sim.parse_fault"
        )
    if "rank" not in values:
        raise ValueError(f"fault spec {spec!r} says no rank; e.g. kill:rank=1:collective=3")
    if action != "stall" and "seconds" in values:
        raise ValueError(f"fault spec {spec!r}: only a stall takes seconds")
    try:
        return Fault(
            action=action,
            rank=int(values["rank"]),
            collective=int(values["collective"]) if "collective" in values else None,
            point=values.get("point"),
            seconds=float(values.get("seconds", DEFAULT_STALL_SECONDS)),
        )
    except ValueError as error:
        raise ValueError(f"fault spec {spec!r}: {error}") from None


def as_faults(faults: object, world_size: int | None = None) -> tuple[Fault, ...]:
    """Faults given as `Fault`s or spec strings, checked (against `world_size` when known)."""
    if faults is None:
        return ()
    if isinstance(faults, (str, Fault)):
        faults = [faults]
    if not isinstance(faults, (list, tuple)):
        raise TypeError(f"faults must be a list of Fault or spec strings, got {faults!r}")
    result = tuple(parse_fault(f) if isinstance(f, str) else f for f in faults)
    for fault in result:
        if not isinstance(fault, Fault):
            raise TypeError(f"faults must be Fault objects or spec strings, got {fault!r}")
        if world_size is not None and fault.rank >= world_size:
            raise ValueError(f"fault {fault.describe()} names rank {fault.rank}, but there are {world_size} ranks")
    return result


# -- inside a rank ----------------------------------------------------------------------

#: this rank's faults for the task now running (set by the rank loop; empty outside the simulator)
_armed: list[Fault] = []


def arm(faults: tuple[Fault, ...], rank: int) -> None:
    """Make this rank's faults of `faults` fire during the coming task (called in the rank)."""
    _armed[:] = [fault for fault in faults if fault.rank == rank]


def disarm() -> None:
    """No faults any more (end of a task)."""
    _armed.clear()


def armed() -> bool:
    """Whether any fault is armed in this process."""
    return bool(_armed)


def at_collective(count: int) -> None:
    """Fire the fault armed for this rank's `count`-th collective, if any."""
    for fault in _armed:
        if fault.collective == count:
            _fire(fault, f"before its collective #{count}")


def fault_point(name: str) -> None:
    """Mark a point where an injected fault may fire (``Fault(point=name)``); a no-op outside the simulator."""
    if not _armed:
        return
    for fault in _armed:
        if fault.point == name:
            _fire(fault, f"at fault_point({name!r})")


def _fire(fault: Fault, where: str) -> None:
    if fault.action == "kill":
        # Said on stderr first: the parent's report shows a dead rank's last lines there.
        print(f"accel.sim: injected fault {fault.describe()}: killing this rank {where}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "raise":
        raise InjectedFault(f"injected fault ({fault.describe()}): rank {fault.rank} raised {where}")
    else:
        time.sleep(fault.seconds)
