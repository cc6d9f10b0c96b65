"""Inside a rank process: set up once, then run tasks until the parent says stop.

Set-up (once per process): die with the fork server (and so with the parent), own a
process group so the parent can kill whatever the rank started, send output to
per-rank files the parent relays, make SIGUSR1 dump every thread's Python stack (the
parent asks for it at a timeout), set the launcher's environment, install the
simulated device and let `PartialState()` create the Gloo process group exactly as on
that hardware. Rank 0 hosts the rendezvous store on a port the kernel picks, so that
launches running side by side never collide.

A process of a pool of stand-ins (`accel.sim.runtime.stand_in`) is rank R of a larger world
instead of its place in the pool: its environment and default group are that rank's, and its
groups complete their collectives alone (`accel.sim.cuda.nccl.stand_in`).

With one rank, a process group of size 1 is created too, as the distributed test
bases of torch and DeepSpeed do: code under test may call `dist.get_world_size()`.
Collectives are watched (`accel.sim.diagnoses.collectives`): checked across ranks, counted for
injected faults (`accel.sim.diagnoses.faults`), shown on a board the parent reads.

Then, per task: run the function, report its value or what went wrong, and whether
the process group is still there; then restore the clean slate (`accel.sim.runtime.cleanslate`)
while the parent reports, before the next task comes.
The messages exchanged with the parent are the types of `accel.sim.runtime.messages`.

The fork server has already imported torch and accel (`accel.sim.runtime.entry.PRELOAD`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import accel.state  # noqa: F401  (preloaded: every rank needs it)
from accel.sim.cuda.memory import node as node_memory
from accel.sim.diagnoses import collectives, faults
from accel.sim.runtime import serialize
from accel.sim.runtime.cleanslate import CleanSlate, seed_everything
from accel.sim.runtime.messages import ExceptionReport, Port, Ready, RunTask, StartError, Status, Stop, TaskDone
from accel.sim.runtime.torchrun_env import torchrun_environment

#: source files whose frames are left out of a rank's traceback (the simulator's own)
INTERNAL_FILES: set[str] = {__file__}
#: files whose frames are left out of a traceback: the collective wrapper and the fault
#: injector stand between the user's call and torch, or raise on the user's behalf
RAISING_FILES: set[str] = {collectives.__file__, faults.__file__}

_PR_SET_PDEATHSIG = 1
#: keeps rank 0's rendezvous store (and its server) alive as long as the process
_STORE: list[Any] = []
#: this rank's coverage measurement, when the parent measures coverage
_coverage_started: Any = None


def hide_frames_of(path: str) -> None:
    """Leave frames of `path` out of the tracebacks ranks report (for runners built on this one)."""
    INTERNAL_FILES.add(path)


def serve(config: dict[str, Any], conn: Any, coverage: Any = None) -> None:
    """Entry point of a rank process (see the module docstring); `coverage` measures it, if any."""
    global _coverage_started
    _coverage_started = coverage
    _bind_lifetime_to_parent()
    _redirect_output(config["workdir"], config["rank"])
    # Started by the fork server, this process inherited its start method; a process torchrun
    # starts has the platform's default (DataLoader workers fork from the rank, as they do there).
    multiprocessing.set_start_method(None, force=True)
    try:
        slate = _set_up(config, conn)
        _one_rank_group(_identity(config)[1])
        collectives.install(config["workdir"], config["rank"])
    except BaseException as error:  # whatever failed, the parent must hear why
        conn.send(StartError(describe_exception(error)))
        _exit(1)
    # The first task starts from a reset too (set-up leaves traces, e.g. the device it set).
    slate.reset()
    conn.send(Ready(os.getpid()))
    # A task must leave the process group as it found it.
    had_group = _group_exists()
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            _exit(0)
        if isinstance(message, Stop):
            _exit(0)
        if not isinstance(message, RunTask):
            raise TypeError(f"a rank expects RunTask or Stop from the parent, got {message!r}")
        collectives.begin_task(message.number, message.check_collectives)
        faults.arm(message.faults, config["rank"])
        try:
            done = _run_task(slate, message)
        finally:
            faults.disarm()
            collectives.end_task()
            # Before answering: the next test starts with empty GPUs, and its ranks must not
            # see this one's memory while this rank has not yet reset its device.
            node_memory.start_afresh()
        _flush()
        _save_coverage()
        done = dataclasses.replace(done, pg_ok=_group_exists() == had_group)
        conn.send_bytes(pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL))
        if done.status == Status.EXIT:
            _exit(done.exit_code or 0)
        # Off the next task's path, while the parent reports this one: the clean slate, and
        # the collective check's keys of the task before (every rank is done with those).
        slate.reset(collectives.forget_finished_tasks)


def _group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def _one_rank_group(world_size: int) -> None:
    # accel (as Accelerate) creates no process group for a single process; a test of
    # distributed code still expects one, of size 1. It is created by the device's own
    # backend, as `PartialState` would have.
    if world_size != 1 or _group_exists():
        return
    from accel.state import PartialState, reset_state

    PartialState().hardware.init_process_group()
    reset_state()


# -- process set-up --------------------------------------------------------------------


def _bind_lifetime_to_parent() -> None:
    # The fork server hands every child the parent's "alive" pipe; holding it would keep
    # the fork server up after the parent dies. Dropping it lets the fork server exit
    # with the parent, and PDEATHSIG then takes this rank down with the fork server.
    from multiprocessing import forkserver

    alive_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):  # already closed: nothing to release
            os.close(alive_fd)
        # private to multiprocessing, which offers no public way to drop that pipe
        forkserver._forkserver._forkserver_alive_fd = None  # type: ignore[attr-defined]  # private, see above
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    # Our own process group: the terminal's Ctrl-C goes to the parent only (which then
    # stops us), and the parent can kill anything this rank started with killpg.
    os.setpgid(0, 0)


def _redirect_output(workdir: str, rank: int) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(workdir, f"rank{rank}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    # One file for stacks asked for with SIGUSR1 and for fatal signals (SIGSEGV, ...).
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "a")  # noqa: SIM115  (open for the process lifetime)
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)


def _identity(config: dict[str, Any]) -> tuple[int, int]:
    """(rank, world size) this process is: its place in the pool, or the rank of a larger world it stands in as."""
    stand_in = config.get("stand_in")
    if stand_in is not None:
        return stand_in["rank"], stand_in["world_size"]
    return config["rank"], config["world_size"]


def _set_up(config: dict[str, Any], conn: Any) -> CleanSlate:
    device = config["device"]
    rank, world_size = _identity(config)
    os.environ.clear()
    os.environ.update(config["env"])
    # torch reads TORCH_DISTRIBUTED_DEBUG when it is imported, which the fork server did
    # with its own environment: read it again from the launch's.
    dist.set_debug_level_from_env()
    # Exactly what torchrun gives a worker (the launch may override the restart counters).
    run_id = os.path.basename(config["workdir"])
    os.environ.update(torchrun_environment(rank, world_size, run_id, config["workdir"]))
    _on_the_launch_node(device if not config["real_device"] else "real", config["workdir"])
    torch.set_num_threads(config["num_threads"])
    # The pool's first process hosts the rendezvous store (with stand-ins: rank 0 of the pool, whichever rank it is).
    os.environ["MASTER_PORT"] = str(_rendezvous_port(config["rank"], world_size, conn))
    reset_device = _prepare_device(device, config["real_device"])
    if config.get("stand_in") is not None:
        from accel.sim.cuda.nccl import stand_in

        stand_in.install(config["stand_in"]["description"])  # before the default group is made
    from accel.state import PartialState, reset_state

    PartialState()  # creates the process group through the backend, as on the hardware
    reset_state()  # tests start from nothing; the process group stays
    seed_everything(0)
    return CleanSlate(reset_device)


def _on_the_launch_node(device: str, workdir: str) -> None:
    """The ranks of a launch are the processes of one node (its folder: the launch's), sharing its GPUs'
    memory (`accel.sim.cuda.memory.node`); Python processes they start join it (`accel.sim.node`)."""
    os.environ[node_memory.NODE_ENV] = workdir
    if device in ("cuda", "xla"):
        os.environ["ACCEL_SIMULATE"] = f"{device}:{os.environ['LOCAL_WORLD_SIZE']}"
    else:
        os.environ.pop("ACCEL_SIMULATE", None)


def _rendezvous_port(rank: int, world_size: int, conn: Any) -> int:
    if rank == 0:
        # Multi-tenant: the env:// rendezvous of this process reuses this very server.
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, multi_tenant=True, wait_for_workers=False)
        _STORE.append(store)
        conn.send(Port(store.port))
        return store.port
    message = conn.recv()
    if not isinstance(message, Port):
        raise RuntimeError(f"expected the rendezvous port from the parent, got {message!r}")
    return message.port


def _prepare_device(device: str, real_device: bool) -> Callable[[], None]:
    """Install the device; returns what puts it back in its start-up state between tests."""
    from accel.backends import ENV_VAR

    if real_device:
        os.environ[ENV_VAR] = device
        return lambda: None
    try:
        from accel.sim import devices
    except ImportError:
        if device != "cpu":
            raise
        os.environ[ENV_VAR] = "cpu"
        return lambda: None
    devices.prepare_rank(device)
    return lambda: devices.reset_rank(device)


# -- tasks -----------------------------------------------------------------------------


def _run_task(slate: CleanSlate, task: RunTask) -> TaskDone:
    try:
        slate.enter(task.cwd, task.sys_path)
        fn, args, kwargs = serialize.loads(task.payload)
        value = fn(*args, **kwargs)
    except SystemExit as exit_:
        return TaskDone(Status.EXIT, exit_code=_exit_code(exit_))
    except BaseException as error:  # skips and KeyboardInterrupt are reported too
        return TaskDone(Status.EXCEPTION, error=describe_exception(error))
    try:
        return TaskDone(Status.OK, value=serialize.dumps(value))
    except TypeError as error:
        return TaskDone(Status.EXCEPTION, error=describe_exception(error))


def _exit_code(exit_: SystemExit) -> int:
    code = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # as the interpreter does for sys.exit("message")
    return 1


def describe_exception(error: BaseException) -> ExceptionReport:
    """The exception as the parent reports it: type, message, the rank's own traceback, the object."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in INTERNAL_FILES:
        tb = tb.tb_next
    tb = _without_wrapper_frames(tb)
    kind = type(error)
    module = kind.__module__
    try:
        pickled = pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # the text below still says everything
        pickled = None
    return ExceptionReport(
        exc_type=kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}",
        message=str(error),
        traceback="".join(traceback.format_exception(kind, error, tb)),
        exception=pickled,
    )


def _without_wrapper_frames(tb: Any) -> Any:
    """The traceback without the collective wrapper's and fault injector's frames.

    They sit between the user's call and torch's function (or raise on the user's
    behalf): the user's frame and torch's are the ones that explain the error.
    """
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename not in RAISING_FILES:
            kept.append(tb)
        tb = tb.tb_next
    for earlier, later in zip(kept, kept[1:], strict=False):
        earlier.tb_next = later
    if kept:
        kept[-1].tb_next = None
    return kept[0] if kept else None


def _save_coverage() -> None:
    # Now, after every task: the rank may be killed before it exits.
    if _coverage_started is None:
        return
    try:
        _coverage_started.save()
    except Exception as error:  # losing coverage data must not fail the test
        print(f"accel.sim: could not save this rank's coverage data: {error!r}", file=sys.stderr)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # a test closed or broke the stream
                stream.flush()


def _exit(code: int) -> None:
    # No coverage save here: each task's data was saved when it ended, and a save now
    # (at the end of a session) would come after pytest-cov combined the data files,
    # leaving a stray one for the next run to pick up.
    _flush()
    os._exit(code)
