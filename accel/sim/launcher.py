"""`launch`: run a function on N simulated ranks and get back what each returned.

Ranks come warm from a pool (`accel.sim.pool`); a launch that ended badly throws its
pool away so that the next one starts from healthy ranks. Failures are raised as one
`DistributedFailure` naming every failed rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from accel.sim import device_names, serialize
from accel.sim import manager as managers
from accel.sim import pool as pools
from accel.sim.failures import DistributedFailure, DistributedTimeout

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


def check_options(world_size: int, device: str, timeout: float, real_device: bool = False) -> None:
    """Reject what cannot be launched, with a message that says what to pass instead."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not real_device and device not in known_devices():
        raise ValueError(f"unknown simulated device {device!r}; choose one of {', '.join(known_devices())}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def run_payload(
    payload: bytes,
    world_size: int,
    device: str,
    timeout: float,
    isolated: bool = False,
    real_device: bool = False,
    manager: managers.PoolManager | None = None,
    in_step_exceptions: Iterable[str] = IN_STEP_EXCEPTIONS,
) -> list[pools.RankOutcome]:
    """Run a serialised call on the ranks; the outcomes, one per rank (raises only if ranks cannot start)."""
    manager = manager or default_manager()
    pool = manager.acquire(world_size, device, real_device=real_device, isolated=isolated)
    reusable = False
    try:
        outcomes = pool.run(payload, timeout)
        in_step = set(in_step_exceptions)
        reusable = not isolated and all(
            outcome.pg_ok
            and (outcome.status == "ok" or (outcome.status == "exception" and outcome.failure.exc_type in in_step))
            for outcome in outcomes
        )
        return outcomes
    finally:
        manager.release(pool, reusable)


#: which failures are listed first: a rank that died usually makes its peers' collectives
#: fail ("connection reset by peer"), so deaths come before exceptions, and those before
#: timeouts; within a kind, the one the parent learnt of first
_CAUSE_ORDER = {"signal": 0, "exit": 0, "exception": 1, "timeout": 2}


def raise_for_failures(
    outcomes: list[pools.RankOutcome], world_size: int, device: str, timeout: float | None = None
) -> None:
    """Raise `DistributedFailure` (or `DistributedTimeout`) if any rank did not return."""
    failed = sorted(
        (o for o in outcomes if o.status not in ("ok", "stopped")), key=lambda o: (_CAUSE_ORDER[o.status], o.seq)
    )
    failures = {o.rank: o.failure for o in failed}
    stopped = {o.rank: o.failure for o in outcomes if o.status == "stopped"}
    if not failures and not stopped:
        return
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
    timeout: float = 60,
    isolated: bool = False,
    *,
    real_device: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` simulated ranks; the list of their return values.

    Each rank is a process with a real Gloo process group, the launcher's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the
    simulated `device` ("cpu", "cuda" or "xla") installed, so `PartialState()` is set up
    as on that hardware. Ranks are kept warm between launches and start each one clean;
    `isolated=True` uses fresh processes. What ranks print is relayed, prefixed
    ``[rank N]``.

    Raises:
        DistributedFailure: a rank raised, exited or was killed (every failed rank is
            named with its own traceback, exit code or signal).
        DistributedTimeout: ranks were still running `timeout` seconds after the call
            was sent to them (starting fresh ranks is not counted); each live rank's
            Python stack is in the message, and the ranks are killed.

    `real_device=True` runs on the real hardware instead (`device="cuda"`: one GPU per
    rank, NCCL), with nothing simulated.
    """
    check_options(world_size, device, timeout, real_device)
    payload = serialize.dumps_call(fn, args, kwargs or {})
    outcomes = run_payload(payload, world_size, device, timeout, isolated, real_device)
    raise_for_failures(outcomes, world_size, device, timeout)
    return [serialize.loads(o.value) if o.value is not None else None for o in outcomes]


__all__ = ["launch", "DistributedFailure", "DistributedTimeout", "run_payload", "raise_for_failures", "default_manager"]
