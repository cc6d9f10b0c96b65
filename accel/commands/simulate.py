"""`accel launch --simulate`: the script on N simulated ranks of `accel.sim.launch`.

What the ranks print streams live (`accel.sim.runtime.output`), each line prefixed ``[rank N]``
unless a single rank is shown; each failing rank's report is printed once, prefixed
the same way; the exit code is that of the first failing rank (`sys.exit(3)` -> 3).
There is no time limit unless `--timeout` is given. Ctrl-C (or SIGTERM) stops every
rank and says so in one line; the exit code is then 128 + the signal, as a shell's.
`--max_restarts N` runs the script again on fresh ranks after a failure, up to N
times, with `TORCHELASTIC_RESTART_COUNT` set as torchrun sets it; faults given with
`--fault` are injected in the first attempt only, as a lost node or a crash would
happen once.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import signal
import sys
from typing import Any

from accel.commands.exit_codes import process_exit_code
from accel.sim.runtime import output

#: the resource tracker's end-of-run warning, left out (see `_quiet_resource_tracker`)
_TRACKER_WARNING_FILTER = "ignore:resource_tracker:UserWarning"


def run_script(script: str, script_args: list[str], env: dict[str, str], module: bool = False) -> None:
    """Run `script` as `__main__` in this (simulated) rank, as `python script ARGS` (or `-m`) would.

    `sys.exit(code)` in the script ends the rank with that code.
    """
    from accel.sim.runtime.launcher import report_peak_memory, report_timing
    from accel.sim.runtime.worker import hide_frames_of

    # A failing rank's traceback then starts at the script, not in this runner.
    hide_frames_of(__file__)
    hide_frames_of(runpy.run_path.__code__.co_filename)  # "<frozen runpy>" on 3.11+
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from accel.sim.devices import as_fresh_process

    as_fresh_process()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        # the answer people simulate GPUs for, also when the script ends with sys.exit or
        # fails (out of memory): each GPU's peak memory against its card; and how fast its steps were
        report_peak_memory()
        report_timing()


def simulate(args: argparse.Namespace, env: dict[str, str]) -> int:
    """Run the script of `args` on `--num_processes` simulated ranks, restarting as asked; the exit code."""
    world_size = args.num_processes or 2
    try:
        shown = output.parse_ranks(args.local_ranks_filter) if args.local_ranks_filter else None
        faults = _faults(args.fault, world_size)
        _check_only_ranks(args, world_size, faults)
    except ValueError as error:
        print(f"accel launch: {error}", file=sys.stderr)
        return 2
    if shown is not None and not shown & set(range(world_size)):
        print(
            f"accel launch: --local_ranks_filter {args.local_ranks_filter} names no rank of {world_size}",
            file=sys.stderr,
        )
        return 2
    _quiet_resource_tracker()
    env = {**env, **_terminal_env(world_size, shown)}
    if getattr(args, "gpu", None):
        from accel.sim.cuda.gpus.cards import GPU_ENV

        env[GPU_ENV] = args.gpu
    if getattr(args, "shapes_only", False):
        env["ACCEL_SIM_SHAPES_ONLY"] = "1"
    if getattr(args, "memory_report", None):
        from accel.sim.cuda.memory.picture import REPORT_ENV

        env[REPORT_ENV] = os.path.abspath(args.memory_report)  # the ranks write it, from their own directory
    env.update(_timing_env(args))
    script = args.script if args.module else os.path.abspath(args.script)
    # Process-wide output settings: put back afterwards, for callers of cli.main in a process that goes on.
    previous = output.settings()
    output.configure(shown, prefix=None)
    try:
        return _attempts(script, args, env, world_size, faults)
    finally:
        output.configure(previous.ranks, previous.prefix)


def _timing_env(args: argparse.Namespace) -> dict[str, str]:
    """What the ranks' clocks are told: the network, GPUs per node, tokens per step, what Python's clocks read
    (`--clock`), the report's path (removed here first: the ranks of this run add themselves to it)."""
    env = {}
    for flag, name in (
        ("network", "ACCEL_SIM_NETWORK"),
        ("gpus_per_node", "ACCEL_SIM_GPUS_PER_NODE"),
        ("tokens_per_step", "ACCEL_SIM_TOKENS_PER_STEP"),
        ("timing_trace", "ACCEL_SIM_TIMING_TRACE"),
        ("clock", "ACCEL_SIM_CLOCK"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            env[name] = os.path.abspath(value) if flag == "timing_trace" else str(value)
    path = getattr(args, "timing_report", None)
    if path:
        env["ACCEL_SIM_TIMING_REPORT"] = os.path.abspath(path)
        for stale in (path, path + ".lock"):
            if os.path.exists(stale):
                os.remove(stale)
    return env


def _attempts(script: str, args: argparse.Namespace, env: dict[str, str], world_size: int, faults: tuple) -> int:
    """The first run and up to `--max_restarts` more after failures; the exit code."""
    from accel.sim import DistributedFailure

    timeout = args.timeout or None  # None: no limit (a deadlock still ends the run)
    for attempt in range(args.max_restarts + 1):
        attempt_env = {
            **env,
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
        }
        try:
            with _interruptible():
                _start_fork_server()
                _launch(script, args, attempt_env, world_size, timeout, faults if attempt == 0 else ())
            return 0
        except KeyboardInterrupt:
            sys.stdout.flush()
            why = "terminated" if _interruptible.received == signal.SIGTERM else "interrupted"
            print(f"accel launch: {why}; stopped all {world_size} ranks", file=sys.stderr)
            return 128 + (_interruptible.received or signal.SIGINT)
        except DistributedFailure as failure:
            sys.stdout.flush()
            print(format_failures(failure.failures, world_size, getattr(failure, "stopped", None)), file=sys.stderr)
            if attempt < args.max_restarts:
                print(
                    f"accel launch: restarting all {world_size} ranks (restart {attempt + 1} of {args.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            return exit_code(failure.failures)
    raise AssertionError("unreachable: every attempt returns")


def _launch(
    script: str, args: argparse.Namespace, env: dict[str, str], world_size: int, timeout: float | None, faults: tuple
) -> None:
    from accel.sim import launch

    options: dict[str, Any] = {}
    if faults:
        options["faults"] = list(faults)
    only_ranks = getattr(args, "only_ranks", None)
    if only_ranks:
        options.update(only_ranks=only_ranks, shapes_only=True)
    try:
        launch(
            run_script,
            args=(script, list(args.script_args), env, bool(args.module)),
            world_size=world_size,
            device=args.simulate,
            timeout=timeout,
            isolated=True,
            **options,
        )
    finally:
        if only_ranks:  # which ranks stood for which, and what that assumes: also after a failure
            from accel.sim.runtime import stand_in

            sys.stdout.flush()
            print(stand_in.plan(world_size, only_ranks, True).summary(), file=sys.stderr, flush=True)


def _check_only_ranks(args: argparse.Namespace, world_size: int, faults: tuple) -> None:
    """`--only_ranks` needs `--shapes_only` and ranks of the world (ValueError saying what to change)."""
    only_ranks = getattr(args, "only_ranks", None)
    if only_ranks:
        from accel.sim.runtime import stand_in

        try:
            stand_in.plan(world_size, only_ranks, bool(getattr(args, "shapes_only", False)), faults)
        except ValueError as error:
            raise ValueError(f"--only_ranks {only_ranks}: {error}") from None


def _faults(specs: list[str], world_size: int) -> tuple:
    if not specs:
        return ()
    from accel.sim.diagnoses import faults

    return faults.as_faults(list(specs), world_size)


class _interruptible:
    """Ctrl-C (SIGINT) or SIGTERM raise KeyboardInterrupt once; later ones wait until the ranks are stopped.

    The ranks run in process groups of their own (the terminal's Ctrl-C reaches only
    us): the launch's clean-up kills them. A signal that arrives while a rank process is
    being requested from the fork server is acted on once that request is answered, or
    the rank would be started after the clean-up, unknown to it.
    """

    #: the signal that interrupted the last launch (None: none did)
    received: int | None = None
    #: how soon a deferred signal is looked at again (seconds)
    RETRY = 0.05

    def __enter__(self) -> None:
        _interruptible.received = None
        self._deferred: int | None = None
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._interrupt)
        signal.signal(signal.SIGALRM, self._retry)

    def _interrupt(self, signum: int, frame: Any) -> None:
        if _requesting_a_process(frame):
            self._deferred = signum
            signal.setitimer(signal.ITIMER_REAL, self.RETRY)
            return
        _interruptible.received = signum
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        raise KeyboardInterrupt

    def _retry(self, signum: int, frame: Any) -> None:
        if self._deferred is not None:
            self._interrupt(self._deferred, frame)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _requesting_a_process(frame: Any) -> bool:
    """Whether `frame` is inside multiprocessing's request for a new process to the fork server."""
    while frame is not None:
        if frame.f_code.co_filename.endswith(("popen_forkserver.py", "multiprocessing/forkserver.py")):
            return True
        frame = frame.f_back
    return False


def _start_fork_server() -> None:
    """Start multiprocessing's resource tracker, then the fork server with Ctrl-C blocked.

    Both are in our process group, so the terminal's Ctrl-C reaches them too. The fork
    server ignores it only once it has imported torch (seconds), and would print a
    traceback of its start-up before that; it inherits our signal mask, so it is spawned
    with SIGINT blocked. The resource tracker protects itself the same way, but unblocks
    SIGINT when it is done, so it is started first, apart. Here a Ctrl-C meanwhile is
    only held back: it arrives once unblocked.
    """
    from multiprocessing import resource_tracker

    from accel.sim.runtime import forking

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forking.warm_up()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _quiet_resource_tracker() -> None:
    """Keep multiprocessing's resource tracker from blaming the user's script for our rank kills.

    Semaphores a rank creates (tqdm makes one for its lock) are registered with the
    tracker; the rank ends by SIGKILL or `os._exit`, by design, so it never unregisters
    them, and at the end of the run the tracker releases them and warns "leaked
    semaphore objects". The tracker is started by this process with its warning
    options, so this filter, set before the first launch, silences that one warning.
    """
    if _TRACKER_WARNING_FILTER not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_WARNING_FILTER)


def _terminal_env(world_size: int, shown: frozenset[int] | None) -> dict[str, str]:
    """On a terminal, tell the ranks they write to one (through us) and its width less the rank prefix.

    A rank writes to a file the parent relays, so libraries would otherwise draw no live
    progress (rich) or size their bars wrongly (tqdm, rich): `TTY_COMPATIBLE` and
    `TTY_INTERACTIVE` (rich's variables) and `COLUMNS` (read by both) fix that. A
    variable the user set is left as it is.
    """
    if not sys.stderr.isatty():
        return {}
    prefixed = len(shown) != 1 if shown is not None else world_size != 1
    width = shutil.get_terminal_size().columns - (len(f"[rank {world_size - 1}] ") if prefixed else 0)
    wanted = {"COLUMNS": str(max(width, 20)), "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    return {name: value for name, value in wanted.items() if name not in os.environ}


def exit_code(failures: dict[int, Any]) -> int:
    """The exit code of the first failing rank (the likely cause, listed first): its own, 128 + a signal, or 1."""
    first = next(iter(failures.values()), None)
    if first is None:
        return 1
    kind = getattr(first, "kind", "exception")
    if kind in ("exit", "signal"):
        return process_exit_code(first.exitcode)
    return 1


def describe_failure(failure: Any) -> str:
    """What went wrong on one rank, in the words a user needs (traceback, exit code, signal, stack)."""
    kind = getattr(failure, "kind", "exception")
    if kind == "exit":
        text = f"exited with code {failure.exitcode}"
    elif kind == "signal":
        text = f"killed by signal {failure.signal_name}"
    elif kind == "timeout":
        text = "timed out" + (
            f"; its stack at that moment:\n{failure.stack}" if failure.stack else " (no stack captured)"
        )
    elif kind == "deadlock":
        text = f"{failure.headline()}\n{failure.stack}"
    else:
        text = failure.traceback or f"{failure.exc_type}: {failure.message}"
    return text.rstrip("\n")


def format_failures(failures: dict[int, Any], world_size: int, stopped: dict[int, Any] | None = None) -> str:
    """Every failing rank's report (in the launcher's order: likely cause first), each line
    prefixed `[rank N]`; then one line per rank stopped because of them; then a summary."""
    blocks = []
    for rank, failure in failures.items():
        lines = describe_failure(failure).splitlines() or [""]
        blocks.append("\n".join(f"[rank {rank}] {line}" for line in lines))
    for rank in sorted(stopped or {}):
        blocks.append(f"[rank {rank}] stopped: still running after another rank had failed")
    ranks = ", ".join(str(rank) for rank in sorted(failures))
    blocks.append(f"accel launch: {len(failures)} of {world_size} ranks failed (rank {ranks})")
    return "\n".join(blocks)
