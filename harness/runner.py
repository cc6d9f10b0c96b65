"""In the pytest process: run one distributed test item and turn its rank outcomes into pytest's.

All ranks returned: the test passed. A rank called `pytest.skip` (or `pytest.xfail`)
and nothing else went wrong of its own accord: the test is skipped (xfailed). Anything
else fails the test: the rank's original exception is raised when there is one (so
that `xfail(raises=...)` can match it), and the report shows every failed rank's own
traceback, prefixed with its rank, then where the other ranks were waiting.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from accel.sim.diagnoses.failures import DistributedFailure
from accel.sim.runtime import launcher, serialize
from accel.sim.runtime.manager import PoolManager
from accel.sim.runtime.messages import Status
from accel.sim.runtime.pool import RankOutcome
from harness import remote
from harness.decorator import ALLOWED_FIXTURES, RANK_FIXTURES, DistributedSpec

#: pytest's outcome exceptions, by class (when the exception came back) or by name
_OUTCOMES = {"skip": pytest.skip.Exception, "xfail": pytest.xfail.Exception}

#: item.stash key: the failure to report for this item's call
FAILURE_KEY = pytest.StashKey[DistributedFailure]()


def shared_kwargs(item: pytest.Function, spec: DistributedSpec) -> dict[str, Any]:
    """The arguments computed in the pytest process, sent to every rank."""
    return {name: item.funcargs[name] for name in spec.params if name != "self" and name not in RANK_FIXTURES}


def unknown_fixtures(item: pytest.Function, spec: DistributedSpec) -> list[str]:
    """Parameters of the body that cannot reach the ranks (other fixtures)."""
    callspec = getattr(item, "callspec", None)
    parametrized = set(callspec.params) if callspec is not None else set()
    params = spec.params[1:] if spec.params[:1] == ("self",) else spec.params
    return [name for name in params if name not in ALLOWED_FIXTURES and name not in parametrized]


def run_item(item: pytest.Function, spec: DistributedSpec, manager: PoolManager, real_device: bool) -> None:
    """Run the item's body on its ranks; returns on success, raises pytest's outcome otherwise."""
    __tracebackhide__ = True
    if FAILURE_KEY in item.stash:  # from an earlier run of this item (e.g. a rerun plugin)
        del item.stash[FAILURE_KEY]
    world_size, device = int(item.funcargs["world_size"]), str(item.funcargs["device"])  # type: ignore[call-overload]  # (funcargs values are typed object)
    launcher.check_options(world_size, device, spec.timeout, real_device)
    # The name pytest collected (the function's own __qualname__ may be that of a
    # wrapper, e.g. hypothesis' @given).
    qualname = item.originalname if item.cls is None else f"{item.cls.__qualname__}.{item.originalname}"
    call = remote.TestCall(
        module=item.module.__name__,
        path=os.path.abspath(item.module.__file__),
        qualname=qualname,
        kwargs=serialize.dumps(shared_kwargs(item, spec)),
        rank_params=tuple(name for name in spec.params if name in RANK_FIXTURES),
        hypothesis_seed=random.SystemRandom().getrandbits(64)
        if getattr(spec.body, "is_hypothesis_test", False)
        else None,
    )
    payload = serialize.dumps_call(remote.run_test, (call,), {})
    try:
        outcomes = launcher.run_payload(
            payload,
            world_size,
            device,
            spec.timeout,
            spec.isolated,
            real_device,
            manager,
            check_collectives=spec.check_collectives,
            faults=spec.faults,
        )
    except DistributedFailure as failure:  # the ranks could not even start
        item.stash[FAILURE_KEY] = failure
        raise
    _conclude(item, outcomes, world_size, device, spec.timeout)


def _pytest_outcome(outcome: RankOutcome) -> str | None:
    """ "skip" or "xfail" when the rank called pytest.skip / pytest.xfail."""
    if outcome.status != Status.EXCEPTION:
        return None
    failure = outcome.failure
    if failure is None:
        return None
    for kind, cls in _OUTCOMES.items():
        if isinstance(failure.exception, cls) or failure.exc_type in (cls.__name__, f"_pytest.outcomes.{cls.__name__}"):
            return kind
    return None


def _conclude(item: pytest.Function, outcomes: list[RankOutcome], world_size: int, device: str, timeout: float) -> None:
    __tracebackhide__ = True
    if all(outcome.status == Status.OK for outcome in outcomes):
        return
    kinds = {o.rank: _pytest_outcome(o) for o in outcomes}
    own = [o for o in outcomes if o.status not in (Status.OK, Status.STOPPED)]
    if own and all(kinds[o.rank] is not None for o in own):
        # Only skips / xfails of their own accord (the others returned or were waiting).
        kind = "skip" if any(kinds[o.rank] == "skip" for o in own) else "xfail"
        first = min((o for o in own if kinds[o.rank] == kind), key=lambda o: o.rank)  # stable reason
        message = first.failure.message if first.failure is not None else ""
        raise _outcome(_OUTCOMES[kind], f"rank {first.rank}: {message}")
    try:
        launcher.raise_for_failures(outcomes, world_size, device, timeout)
    except DistributedFailure as failure:
        item.stash[FAILURE_KEY] = failure
        original = failure.first().exception
        if isinstance(original, Exception):
            raise original from None  # so that xfail(raises=...) sees the rank's exception
        raise


def _outcome(exception_class: type, message: str) -> BaseException:
    try:
        # Reported at the test's location rather than at this file's.
        return exception_class(message, _use_item_location=True)
    except TypeError:
        return exception_class(message)


def longrepr(item: pytest.Item, failure: DistributedFailure) -> Any:
    """The failure as pytest shows it: the multi-rank report, and a one-line crash message."""
    text = failure.report()
    first = failure.first()
    crash_message = (
        failure.summary if first.kind in ("timeout", "deadlock") else f"rank {first.rank}: {first.headline()}"
    )
    try:
        from _pytest._code.code import ReprEntryNative, ReprExceptionInfo, ReprFileLocation, ReprTraceback
    except ImportError:
        return text
    path, lineno, _ = item.location
    lines = [line + "\n" for line in text.splitlines()]
    return ReprExceptionInfo(
        reprtraceback=ReprTraceback([ReprEntryNative(lines)], None, "native"),
        reprcrash=ReprFileLocation(path=str(item.path), lineno=(lineno or 0) + 1, message=crash_message),
    )
