"""The messages between a rank pool (parent) and its rank processes, as named types.

Start-up: rank 0 sends `Port` (its rendezvous port), which the parent passes on to the
other ranks; each rank then sends `Ready`, or `StartError` if its set-up failed. Then,
per task, the parent sends `RunTask` and each rank answers `TaskDone`; `Stop` ends a
rank. Everything here is plain data, free of torch, so that the parent can unpickle it.
"""

from __future__ import annotations

import dataclasses
import enum


class Status(str, enum.Enum):
    """How a rank ended a task (a str: compares equal to its value, e.g. "ok")."""

    OK = "ok"
    #: raised an exception
    EXCEPTION = "exception"
    #: exited without returning (sys.exit with a non-zero code, os._exit)
    EXIT = "exit"
    #: killed by a signal
    SIGNAL = "signal"
    #: still running at the timeout
    TIMEOUT = "timeout"
    #: still running after another rank had failed, then stopped by the parent
    STOPPED = "stopped"
    #: blocked in a collective that could no longer complete (its peers had finished)
    DEADLOCK = "deadlock"


@dataclasses.dataclass(frozen=True)
class ExceptionReport:
    """An exception as a rank reports it: type name, message, the rank's own traceback, the pickled object."""

    exc_type: str
    message: str
    traceback: str
    #: the exception pickled, or None when it cannot be (the text above still says everything)
    exception: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Port:
    """Rank 0's rendezvous port: rank 0 -> parent -> every other rank."""

    port: int


@dataclasses.dataclass(frozen=True)
class Ready:
    """A rank finished its set-up (process group included) and waits for tasks."""

    pid: int


@dataclasses.dataclass(frozen=True)
class StartError:
    """A rank's set-up failed."""

    error: ExceptionReport


@dataclasses.dataclass(frozen=True)
class RunTask:
    """Run one serialised call (`accel.sim.runtime.serialize.dumps_call`) in every rank."""

    payload: bytes
    cwd: str
    sys_path: list[str]
    #: the pool's task counter: names this task's keys in the rendezvous store
    number: int
    #: check every collective across ranks before it runs (`accel.sim.diagnoses.collectives`)
    check_collectives: bool = True
    #: faults to inject (`accel.sim.diagnoses.faults.Fault`), all ranks' (each rank picks its own)
    faults: tuple = ()


@dataclasses.dataclass(frozen=True)
class Stop:
    """Exit now."""


@dataclasses.dataclass(frozen=True)
class TaskDone:
    """What a rank made of a task."""

    status: Status
    #: the serialised return value (status OK)
    value: bytes | None = None
    #: the exit code (status EXIT)
    exit_code: int | None = None
    #: what was raised (status EXCEPTION)
    error: ExceptionReport | None = None
    #: whether the process group is as the task found it (the rank may be reused)
    pg_ok: bool = False
