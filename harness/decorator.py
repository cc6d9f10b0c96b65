"""`@distributed_test`: mark a test whose body runs inside every simulated rank.

The decorator returns a stand-in that pytest collects: its signature is the body's
plus `world_size` and `device` (so that lists of them can parametrize it, and the
plugin always knows them), and it carries a `DistributedSpec` saying how to run the
body. The plugin (`harness.plugin`) runs the spec instead of calling the stand-in;
inside each rank `harness.remote` imports the test module again and calls the body.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from accel.sim.runtime.launcher import GpuOptions

#: fixtures whose value differs per rank: filled in inside each rank
RANK_FIXTURES = ("rank", "local_rank")
#: fixtures computed once in the pytest process and sent to every rank
SHARED_FIXTURES = ("world_size", "device", "tmp_path")
ALLOWED_FIXTURES = RANK_FIXTURES + SHARED_FIXTURES


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """How to run a distributed test: its body, its parameters, and the launch options."""

    body: Callable[..., Any]
    params: tuple[str, ...]
    world_sizes: tuple[int, ...]
    devices: tuple[str, ...]
    timeout: float
    isolated: bool
    #: check collectives across ranks (None: the ACCEL_SIM_CHECK_COLLECTIVES knob, default on)
    check_collectives: bool | None = None
    #: faults to inject (`accel.sim.diagnoses.faults.Fault`)
    faults: tuple[Any, ...] = ()


def _as_tuple(value: Any, name: str, kind: type) -> tuple[Any, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not values or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        article = "an" if kind is int else "a"
        raise TypeError(
            f"@distributed_test({name}=...) takes {article} {kind.__name__} or a list of them, got {value!r}"
        )
    return values


def distributed_test(
    world_size: int | Sequence[int] = 4,
    device: str | Sequence[str] = "cpu",
    timeout: float = 60,
    isolated: bool = False,
    check_collectives: bool | None = None,
    faults: Sequence[Any] = (),
    gpu: str | None = None,
    report_memory: bool = False,
    shapes_only: bool = False,
    timing_report: str | os.PathLike[str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated test's body on `world_size` simulated ranks of `device`.

    `world_size` and `device` may be lists: the test is then parametrized over them
    (and may take `world_size` / `device` as arguments). The body may take the
    fixtures `rank`, `local_rank`, `world_size`, `device`, `tmp_path` (one directory
    shared by all ranks) and `pytest.mark.parametrize` arguments. It runs in warm rank
    processes that start every test clean; `isolated=True` asks for fresh ones. A test
    still running after `timeout` seconds fails with every live rank's stack.

    Collectives are checked across ranks before they run: ranks calling different ones
    fail the test at once, naming each rank's call and line (`check_collectives=False`
    turns that off; so does ``ACCEL_SIM_CHECK_COLLECTIVES=0``). Ranks left waiting in
    collectives that can never complete (peers returned, or wait in another group's
    collective) fail it within a second.
    `faults` injects failures: `accel.sim.Fault` objects or spec strings such as
    ``"kill:rank=1:collective=3"`` (`accel.sim.diagnoses.faults.parse_fault`).
    `gpu` names the card of the simulated GPUs (``device="cuda"``): "H100", "L4", ... or
    "memory=24GiB,capability=8.9" (`accel.sim.cuda.gpus.cards`); default ``ACCEL_SIM_GPU``, else an H100.
    `report_memory=True`: each rank prints its GPUs' peak memory after the body (shown with
    the test's output: ``pytest -rP`` or ``-s``). `shapes_only=True`: the simulated GPUs hold
    shapes, not data (`accel.sim.cuda.gpus.shapes`): memory and out-of-memory without the compute.
    `timing_report=PATH` (``device="cuda"``): after the body each rank prints its predicted step time and
    puts its steps in the JSON file PATH, replacing its own entry there, as ``ACCEL_SIM_TIMING_REPORT``
    does (`accel.sim.cuda.timing.report`); a test run again rewrites them, entries of ranks it lacks stay.
    """
    from accel.sim.diagnoses.faults import as_faults

    injected = as_faults(list(faults))
    world_sizes, devices = _checked_options(world_size, device, timeout, check_collectives, gpu, shapes_only)
    timing = _checked_timing_report(timing_report, devices)
    mark = _distributed_mark(world_size, device, timeout, isolated, check_collectives, injected)

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        signature = _checked_signature(body)
        spec = DistributedSpec(
            body=_with_gpu_options(body, gpu, report_memory, shapes_only, timing),
            params=tuple(signature.parameters),
            world_sizes=world_sizes,
            devices=devices,
            timeout=float(timeout),
            isolated=bool(isolated),
            check_collectives=check_collectives,
            faults=injected,
        )
        return _collected(_stand_in(body, signature), spec, mark)

    return decorate


def _distributed_mark(
    world_size: int | Sequence[int],
    device: str | Sequence[str],
    timeout: float,
    isolated: bool,
    check_collectives: bool | None,
    faults: tuple[Any, ...],
) -> pytest.MarkDecorator:
    """The `distributed` mark of a test, holding the decorator's options as they were given."""
    return pytest.mark.distributed(
        world_size=world_size,
        device=device,
        timeout=timeout,
        isolated=isolated,
        check_collectives=check_collectives,
        faults=faults,
    )


def _collected(distributed: Callable[..., Any], spec: DistributedSpec, mark: pytest.MarkDecorator) -> Any:
    """The stand-in as pytest collects it: carrying `spec` and `mark`, parametrized over the world
    sizes and devices when there are several."""
    distributed._accel_distributed = spec  # type: ignore[attr-defined]  # our marker on the function
    marked: Any = mark(distributed)
    if len(spec.world_sizes) > 1:
        marked = pytest.mark.parametrize("world_size", spec.world_sizes)(marked)
    if len(spec.devices) > 1:
        marked = pytest.mark.parametrize("device", spec.devices)(marked)
    return marked


def _checked_options(
    world_size: int | Sequence[int],
    device: str | Sequence[str],
    timeout: float,
    check_collectives: bool | None,
    gpu: str | None,
    shapes_only: bool,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The world sizes and devices asked for, once the decorator's options are known to be valid."""
    from accel.sim.runtime.launcher import check_gpu

    if check_collectives is not None and not isinstance(check_collectives, bool):
        raise TypeError(
            f"@distributed_test(check_collectives=...) takes True, False or None, got {check_collectives!r}"
        )
    world_sizes = _as_tuple(world_size, "world_size", int)
    devices = _as_tuple(device, "device", str)
    if any(size < 1 for size in world_sizes):
        raise ValueError(f"@distributed_test(world_size=...) must be positive, got {world_size!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"@distributed_test(timeout=...) must be a positive number of seconds, got {timeout!r}")
    if gpu is not None or shapes_only:
        try:
            check_gpu(gpu or "", devices)
        except ValueError as error:
            raise ValueError(f"@distributed_test: {error}") from None
    return world_sizes, devices


def _checked_timing_report(path: str | os.PathLike[str] | None, devices: tuple[str, ...]) -> str | None:
    """The timing report's absolute path (None: none asked), once it is known to apply to `devices`."""
    if path is None:
        return None
    from accel.sim.runtime.launcher import check_timing_report

    try:
        return check_timing_report(path, devices)
    except ValueError as error:
        raise ValueError(f"@distributed_test: {error}") from None


def _checked_signature(body: Callable[..., Any]) -> inspect.Signature:
    """The signature of a test body the ranks can call: a plain function naming each fixture it takes."""
    if not inspect.isfunction(body):
        raise TypeError(f"@distributed_test decorates a test function, got {body!r}")
    if inspect.iscoroutinefunction(body) or inspect.isgeneratorfunction(body):
        raise TypeError(
            f"@distributed_test cannot run {body.__qualname__}: async and generator tests are not supported"
        )
    signature = inspect.signature(body)
    variadic = [p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise TypeError(f"@distributed_test: {body.__qualname__} takes *{variadic[0]}; name each fixture it needs")
    return signature


def _stand_in(body: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    """What pytest collects in place of `body`: it refuses to be called, and its signature adds
    `world_size` and `device` to the body's so that they can parametrize it."""

    @functools.wraps(body)
    def distributed(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{body.__qualname__} is a @distributed_test: run it with pytest and the accel harness plugin "
            "(entry point 'accel_harness'), or call accel.sim.launch yourself"
        )

    # The stand-in must not look like a hypothesis test to pytest's hypothesis plugin:
    # @given runs inside the ranks (on `body`), and the plugin's checks of the
    # stand-in (function-scoped fixtures such as `rank`) do not apply to it.
    for name in [
        key for key in vars(distributed) if key in ("hypothesis", "is_hypothesis_test") or key.startswith("_hypothesis")
    ]:
        delattr(distributed, name)

    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY)
        for name in ("world_size", "device")
        if name not in signature.parameters
    ]
    distributed.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *extra])  # type: ignore[attr-defined]  # read by pytest
    return distributed


def _with_gpu_options(
    body: Callable[..., Any], gpu: str | None, report_memory: bool, shapes_only: bool, timing_report: str | None
) -> Callable[..., Any]:
    """`body` as the ranks run it: itself, or on simulated GPUs when the decorator asks for a card,
    a memory report, shapes only or a timing report."""
    if gpu is None and not report_memory and not shapes_only and timing_report is None:
        return body
    from accel.sim.runtime.launcher import GpuOptions

    return _on_gpu(body, GpuOptions(gpu, bool(report_memory), bool(shapes_only), timing_report))


def _on_gpu(body: Callable[..., Any], options: GpuOptions) -> Callable[..., Any]:
    """`body`, run on simulated GPUs as `options` say (the card, a peak report, shapes only, a timing report)."""
    from accel.sim.runtime.launcher import on_gpu

    @functools.wraps(body)
    def run_on_gpu(*args: Any, **kwargs: Any) -> Any:
        return on_gpu(options, body, *args, **kwargs)

    return run_on_gpu


def spec_of(obj: Any) -> DistributedSpec | None:
    """The DistributedSpec of a collected test object (function or bound method), if any."""
    return getattr(obj, "_accel_distributed", None)
