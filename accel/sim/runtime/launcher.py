"""`launch`: run a function on N simulated ranks and get back what each returned.

Ranks come warm from a pool (`accel.sim.runtime.pool`); a launch that ended badly throws its
pool away so that the next one starts from healthy ranks. Failures are raised as one
`DistributedFailure` naming every failed rank (`DistributedTimeout`,
`DistributedDeadlock` for those two causes).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from accel.sim import device_names
from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.memory.picture import REPORT_ENV
from accel.sim.cuda.memory.picture import check_path as check_report_path
from accel.sim.diagnoses import faults as fault_specs
from accel.sim.diagnoses.deadlock import ranges
from accel.sim.diagnoses.failures import DistributedDeadlock, DistributedFailure, DistributedTimeout
from accel.sim.runtime import manager as managers
from accel.sim.runtime import pool as pools
from accel.sim.runtime import serialize
from accel.sim.runtime.messages import Status

#: ``ACCEL_SIM_TIMING_REPORT`` (`accel.sim.cuda.timing.report`, which imports torch: not imported here)
TIMING_REPORT_ENV = "ACCEL_SIM_TIMING_REPORT"

#: environment knob: "0" (or false/no/off) turns the collective check off where the
#: caller does not say (`check_collectives=None`)
CHECK_ENV = "ACCEL_SIM_CHECK_COLLECTIVES"

#: exception types (qualified names) after which the ranks are still in step: a pool
#: whose ranks all ended with one of these (or returned) is kept warm
IN_STEP_EXCEPTIONS = frozenset({"Skipped", "_pytest.outcomes.Skipped"})  # pytest names it as a builtin

_default_manager: managers.PoolManager | None = None


def default_manager() -> managers.PoolManager:
    """The process-wide pool manager used by `launch`."""
    global _default_manager
    if _default_manager is None:
        _default_manager = managers.new_manager()
    return _default_manager


#: the simulated devices (one definition, torch-free: `accel.sim.device_names`)
DEVICES = device_names.DEVICES


def known_devices() -> tuple[str, ...]:
    """The devices `launch` can simulate."""
    return DEVICES


def check_options(world_size: int, device: str, timeout: float | None, real_device: bool = False) -> None:
    """Reject what cannot be launched, with a message that says what to pass instead."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not real_device and device not in known_devices():
        raise ValueError(f"unknown simulated device {device!r}; choose one of {', '.join(known_devices())}")
    if timeout is not None and (not timeout or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds (or None: no limit), got {timeout!r}")


@dataclasses.dataclass(frozen=True)
class GpuOptions:
    """What the simulated GPUs of a call are: the card (None: as configured), a memory report (True, or the
    path of its picture), shapes only, the JSON timing report's absolute path (None: none)."""

    gpu: str | None = None
    report_memory: bool | str = False
    shapes_only: bool = False
    timing_report: str | None = None


def check_timing_report(path: str | os.PathLike[str], device: str | Sequence[str], real_device: bool = False) -> str:
    """The timing report's absolute path, once it is known to apply (simulated GPUs) and to be writable there."""
    devices = (device,) if isinstance(device, str) else tuple(device)
    if real_device or "cuda" not in devices:
        raise ValueError(
            f"timing_report={os.fspath(path)!r} holds the simulated GPUs' predicted step times: it needs "
            f"device='cuda' (simulated), got {device!r}"
        )
    absolute = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.dirname(absolute)):
        raise ValueError(f"timing_report={os.fspath(path)!r}: no folder {os.path.dirname(absolute)!r} to write it in")
    return absolute


def check_gpu(gpu: str, device: str | Sequence[str], real_device: bool = False) -> None:
    """A card (or shapes only) is asked only of simulated GPUs, and the card must be one `gpu_models` knows."""
    devices = (device,) if isinstance(device, str) else tuple(device)
    what = f"gpu={gpu!r} names the card of" if gpu else "shapes_only=True applies to"
    if real_device or "cuda" not in devices:
        raise ValueError(f"{what} simulated GPUs: it needs device='cuda' (simulated), got {device!r}")
    if gpu:
        gpu_models.check(gpu)


def on_gpu(options: GpuOptions, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """In a rank: `fn(*args, **kwargs)` on simulated GPUs as `options` say.

    The card and shapes-only are read when CUDA starts in the rank (the clock starts again then:
    the timing report holds the steps of this call); the rank's environment is put back after the
    call. With `report_memory`, what uses each simulated GPU's memory is followed
    (`accel.sim.cuda.memory.report`) and its peak printed once `fn` returned. With `timing_report`,
    the rank prints its predicted step and adds its steps to that JSON file, as
    ``ACCEL_SIM_TIMING_REPORT`` has it do at the end of a script, also when `fn` raised.
    """
    if options.gpu is not None:
        os.environ[gpu_models.GPU_ENV] = options.gpu
    if options.report_memory:
        os.environ[REPORT_ENV] = options.report_memory if isinstance(options.report_memory, str) else "1"
    if options.shapes_only:
        os.environ["ACCEL_SIM_SHAPES_ONLY"] = "1"
    if options.timing_report:
        os.environ[TIMING_REPORT_ENV] = options.timing_report
    fake_cuda = sys.modules.get("accel.sim.cuda.fake")  # loaded in simulated GPU ranks only
    if fake_cuda is not None:
        fake_cuda.reconfigure()  # the rank's set-up may have started CUDA before this call
    try:
        result = fn(*args, **kwargs)
    finally:
        if options.timing_report:
            report_timing()
    if options.report_memory:
        report_peak_memory()
    return result


def report_peak_memory() -> None:
    """Print one line per simulated GPU this rank used: its peak memory against its card."""
    properties = sys.modules.get("accel.sim.cuda.torch_cuda.properties")  # loaded in simulated GPU ranks only
    if properties is None:
        return
    for line in properties.peak_report():
        print(f"accel.sim: {line}", flush=True)


def report_timing() -> None:
    """Print this rank's predicted step time (the simulated GPUs' clock), and add its steps to the timing report
    if ``ACCEL_SIM_TIMING_REPORT`` names one."""
    if "accel.sim.cuda.timing.clock" not in sys.modules:  # loaded in simulated GPU ranks only
        return
    from accel.sim.cuda.timing import report

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    text = report.line(rank, world_size)
    if text:
        print(f"accel.sim: {text}", flush=True)
    path = os.environ.get(report.REPORT_ENV)
    if path:
        report.write(path, rank)
    traced = os.environ.get("ACCEL_SIM_TIMING_TRACE")
    if traced:
        from accel.sim.cuda.timing import clock, trace

        running = clock.current()
        written = trace.write(traced, running, rank, world_size) if running is not None else None
        if written:
            print(f"accel.sim: rank {rank}'s last step traced to {written} (and its picture, .svg)", flush=True)


def resolve_check(check_collectives: bool | None) -> bool:
    """Whether to check collectives: the caller's choice, else the `ACCEL_SIM_CHECK_COLLECTIVES` knob (default on)."""
    if check_collectives is not None:
        return bool(check_collectives)
    value = os.environ.get(CHECK_ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"{CHECK_ENV}={value!r}: use 1 (check collectives across ranks, the default) or 0")


def run_payload(
    payload: bytes,
    world_size: int,
    device: str,
    timeout: float | None,
    isolated: bool = False,
    real_device: bool = False,
    manager: managers.PoolManager | None = None,
    in_step_exceptions: Iterable[str] = IN_STEP_EXCEPTIONS,
    check_collectives: bool | None = None,
    faults: Sequence[fault_specs.Fault | str] | None = None,
) -> list[pools.RankOutcome]:
    """Run a serialised call on the ranks; the outcomes, one per rank (raises only if ranks cannot start).

    `check_collectives` None follows the `ACCEL_SIM_CHECK_COLLECTIVES` knob; `faults` are
    `accel.sim.diagnoses.faults.Fault`s or their spec strings (`accel.sim.diagnoses.faults.parse_fault`).
    """
    check = resolve_check(check_collectives)
    injected = fault_specs.as_faults(faults, world_size)
    manager = manager or default_manager()
    pool = manager.acquire(world_size, device, real_device=real_device, isolated=isolated)
    reusable = False
    try:
        outcomes = pool.run(payload, timeout, check_collectives=check, faults=injected)
        in_step = set(in_step_exceptions)
        reusable = not isolated and all(
            outcome.pg_ok
            and (
                outcome.status == Status.OK
                or (
                    outcome.status == Status.EXCEPTION
                    and outcome.failure is not None
                    and outcome.failure.exc_type in in_step
                )
            )
            for outcome in outcomes
        )
        return outcomes
    finally:
        manager.release(pool, reusable)


#: which failures are listed first: a rank that died usually makes its peers' collectives
#: fail ("connection reset by peer"), so deaths come before exceptions, and those before
#: timeouts; within a kind, the one the parent learnt of first
_CAUSE_ORDER = {"signal": 0, "exit": 0, "exception": 1, "timeout": 2, "deadlock": 2}


def raise_for_failures(
    outcomes: list[pools.RankOutcome], world_size: int, device: str, timeout: float | None = None
) -> None:
    """Raise `DistributedFailure` (or `DistributedTimeout`, `DistributedDeadlock`) if any rank did not return."""
    failed = sorted(
        (o for o in outcomes if o.status not in (Status.OK, Status.STOPPED)),
        key=lambda o: (_CAUSE_ORDER[o.status.value], o.seq),
    )
    failures = {o.rank: o.failure for o in failed if o.failure is not None}
    stopped = {o.rank: o.failure for o in outcomes if o.status == Status.STOPPED and o.failure is not None}
    if not failures and not stopped:
        return
    mismatches = {f.message for f in failures.values() if (f.exc_type or "").endswith("CollectiveMismatch")}
    if len(mismatches) == 1 and len(mismatches) == len({f.message for f in failures.values()}):
        # Every failed rank raised the same report: say it once, in the summary.
        summary = next(iter(mismatches)).splitlines()[0]
        in_order = dict(sorted(failures.items()))  # all alike: rank order reads best
        raise DistributedFailure(in_order, stopped, world_size, device, summary=f"{summary} (device {device!r})")
    if failures and all(f.kind == "deadlock" for f in failures.values()):
        done = [o.rank for o in outcomes if o.status == Status.OK]
        waits = "; ".join(f"rank {rank} {failure.waiting}" for rank, failure in sorted(failures.items()))
        if done:
            why = f"{'rank' if len(done) == 1 else 'ranks'} {ranges(done)} already returned"
        else:
            why = "each waits for another: none of these collectives can complete"
        summary = f"deadlock: {waits}; {why} (device {device!r})"
        raise DistributedDeadlock(failures, stopped, world_size, device, summary=summary)
    if failures and all(f.kind == "timeout" for f in failures.values()):
        ranks = ", ".join(str(rank) for rank in sorted(failures))
        after = f" after {timeout:g} s" if timeout else ""
        summary = (
            f"timed out{after}: rank(s) {ranks} of {world_size} still running (device {device!r}); their stacks follow"
        )
        raise DistributedTimeout(failures, stopped, world_size, device, summary=summary)
    raise DistributedFailure(failures, stopped, world_size, device)


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    world_size: int = 2,
    device: str = "cpu",
    timeout: float | None = 60,
    isolated: bool = False,
    *,
    real_device: bool = False,
    check_collectives: bool | None = None,
    faults: Sequence[fault_specs.Fault | str] | None = None,
    gpu: str | None = None,
    report_memory: bool | str = False,
    shapes_only: bool = False,
    only_ranks: str | Iterable[int] | None = None,
    timing_report: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` simulated ranks; the list of their return values.

    Each rank is a process with a real Gloo process group, the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the simulated `device` ("cpu", "cuda" or "xla") installed, so
    `PartialState()` is set up as on that hardware. Ranks are kept warm between launches and start each one clean;
    `isolated=True` uses fresh processes. What ranks print is relayed, prefixed ``[rank N]``. With `world_size=1` the
    rank still has a process group (of size 1).

    Every collective is checked across ranks before it runs (`check_collectives`, default: on unless
    ``ACCEL_SIM_CHECK_COLLECTIVES=0``): ranks calling different collectives fail at once with `CollectiveMismatch`,
    naming each rank's collective and the line that called it. `faults` injects failures (`accel.sim.Fault` or spec
    strings such as ``"kill:rank=1:collective=3"``, see `accel.sim.diagnoses.faults.parse_fault`).

    Raises:
        DistributedFailure: a rank raised, exited or was killed (every failed rank is named with its own traceback, exit
            code or signal).
        DistributedTimeout: ranks were still running `timeout` seconds after the call was sent to them (starting fresh
            ranks is not counted); each live rank's Python stack is in the message, and the ranks are killed.
            `timeout=None` sets no limit.
        DistributedDeadlock: ranks waited in a collective their peers would never join (those had returned); raised
            within about a second, with the waiting ranks' collectives, locations and stacks.

    `real_device=True` runs on the real hardware instead (`device="cuda"`: one GPU per rank, NCCL), with nothing
    simulated.

    `gpu` (with ``device="cuda"``) names the card each simulated GPU is ("H100", "L4", "memory=24GiB,capability=8.9",
    see `accel.sim.cuda.gpus.cards`); default: ``ACCEL_SIM_GPU``, else an H100. Its memory is what the ranks may
    allocate before out-of-memory. `report_memory=True` has each rank print its GPUs' whole-run peak memory when `fn`
    returns, and what made it up (by category, top modules; `accel.sim.memory_report()` inside `fn`); a path (``.html``
    or ``.svg``) also has each rank draw its memory over the step of the peak there. `shapes_only=True`: the simulated
    GPUs hold shapes, not data (`accel.sim.cuda.gpus.shapes`): whether a step fits on the card, and its peak memory,
    without computing it. `only_ranks` (with `shapes_only`; "0,63", "0-3" or ints) runs only those ranks of the world,
    each standing in for the ranks after it (`accel.sim.runtime.stand_in`); the values of those ranks, in order.
    `timing_report` (a path, with ``device="cuda"``): each rank prints its predicted step time when `fn` returns and
    adds its steps (between returns of the first optimizer's `step()`) to that JSON file, as ``ACCEL_SIM_TIMING_REPORT``
    does for a script (`accel.sim.cuda.timing.report`); a file left by an earlier run is removed first.
    """
    check_options(world_size, device, timeout, real_device)
    stand_in = _stand_in_plan(world_size, only_ranks, shapes_only, faults)
    options = _gpu_options(device, real_device, gpu, report_memory, shapes_only, timing_report)
    if options is not None and options.timing_report:
        _remove_stale_report(options.timing_report)
    payload = _payload(fn, args, kwargs, options)
    outcomes = _run_on_ranks(
        payload, stand_in, world_size, device, timeout, isolated, real_device, check_collectives, faults
    )
    raise_for_failures(outcomes, world_size, device, timeout)
    return [serialize.loads(o.value) if o.value is not None else None for o in outcomes]


def _stand_in_plan(
    world_size: int, only_ranks: str | Iterable[int] | None, shapes_only: bool, faults: Sequence[Any] | None
) -> Any:
    """Which ranks run, standing in for which others, when `only_ranks` asks for some only (else None)."""
    if only_ranks is None:
        return None
    from accel.sim.runtime import stand_in as stand_ins

    return stand_ins.plan(world_size, only_ranks, shapes_only, faults)


def _gpu_options(
    device: str,
    real_device: bool,
    gpu: str | None,
    report_memory: bool | str,
    shapes_only: bool,
    timing_report: str | os.PathLike[str] | None,
) -> GpuOptions | None:
    """What the call asks of the simulated GPUs (None: nothing), checked first: the card exists, the reports'
    paths can be written, and each option applies to `device`."""
    if gpu is not None or shapes_only:
        check_gpu(gpu or "", device, real_device)
    if isinstance(report_memory, str):
        check_report_path(report_memory)
    timing = check_timing_report(timing_report, device, real_device) if timing_report is not None else None
    if gpu is None and not report_memory and not shapes_only and timing is None:
        return None
    memory = report_memory if isinstance(report_memory, str) else bool(report_memory)
    return GpuOptions(gpu, memory, bool(shapes_only), timing)


def _remove_stale_report(path: str) -> None:
    """The ranks add themselves to the timing report: a file (and its lock) of an earlier run goes first."""
    for stale in (path, path + ".lock"):
        if os.path.exists(stale):
            os.remove(stale)


def _payload(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any] | None, options: GpuOptions | None) -> bytes:
    """The call the ranks make, serialised: ``fn(*args, **kwargs)``, run by `on_gpu` when `options` ask
    something of the simulated GPUs."""
    if options is not None:
        fn, args = on_gpu, (options, fn, *args)
    return serialize.dumps_call(fn, args, kwargs or {})


def _run_on_ranks(
    payload: bytes,
    stand_in: Any,
    world_size: int,
    device: str,
    timeout: float | None,
    isolated: bool,
    real_device: bool,
    check_collectives: bool | None,
    faults: Sequence[fault_specs.Fault | str] | None,
) -> list[pools.RankOutcome]:
    """Run the serialised call on the ranks `stand_in` plans, else on a warm pool of the whole world; the outcomes."""
    if stand_in is not None:
        from accel.sim.runtime import stand_in as stand_ins

        return stand_ins.run(payload, stand_in, device, timeout)
    return run_payload(
        payload,
        world_size,
        device,
        timeout,
        isolated,
        real_device,
        check_collectives=check_collectives,
        faults=faults,
    )


__all__ = [
    "launch",
    "DistributedFailure",
    "DistributedTimeout",
    "DistributedDeadlock",
    "run_payload",
    "raise_for_failures",
    "default_manager",
]
