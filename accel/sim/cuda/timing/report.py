"""What the clock tells at the end of a run: one line per rank, and the timing report's JSON.

The line: the median step time, TFLOPS and MFU per GPU (executed FLOPs against the card's dense BF16
peak, as torchtitan reports MFU), the share of the step that is exposed communication, and tokens/s
per GPU when the run says how many tokens a step holds (``ACCEL_SIM_TOKENS_PER_STEP``, all ranks
together). ``ACCEL_SIM_TIMING_REPORT=PATH`` has each rank add its steps to one JSON file:
``{"card", "network", "gpus_per_node", "ranks": {"0": {"steps": [{"time_s", "compute_s", "comm_s",
"exposed_comm_s", "flops"}, ...]}}}``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
from collections.abc import Iterator
from typing import Any

from accel.sim.cuda.timing import clock as clocks
from accel.sim.cuda.timing import ops

#: ``ACCEL_SIM_TIMING_REPORT``: the JSON file the ranks write their steps to
REPORT_ENV = "ACCEL_SIM_TIMING_REPORT"
#: ``ACCEL_SIM_TOKENS_PER_STEP``: tokens one training step holds, over all ranks (for tokens/s per GPU)
TOKENS_ENV = "ACCEL_SIM_TOKENS_PER_STEP"


def tokens_per_step() -> int | None:
    """The tokens a step holds (all ranks together), if the run said (``ACCEL_SIM_TOKENS_PER_STEP``)."""
    value = os.environ.get(TOKENS_ENV, "").strip()
    if not value:
        return None
    try:
        tokens = int(value)
    except ValueError:
        raise ValueError(f"{TOKENS_ENV}={value!r}: give the tokens of one step over all ranks, e.g. 131072") from None
    if tokens <= 0:
        raise ValueError(f"{TOKENS_ENV}={value!r}: the tokens of a step must be positive")
    return tokens


def summary(clock: clocks.Clock, world_size: int) -> dict[str, float] | None:
    """The median step's figures: time_s, tflops, mfu, exposed_comm_share, and tokens_per_s_per_gpu if known."""
    if not clock.steps:
        return None
    median = statistics.median(step.time_s for step in clock.steps)
    flops = statistics.median(step.flops for step in clock.steps)
    exposed = statistics.median(step.exposed_comm_s / step.time_s if step.time_s else 0.0 for step in clock.steps)
    figures = {
        "time_s": median,
        "tflops": flops / median / 1e12 if median else 0.0,
        "mfu": flops / median / clock.card.speeds.peak("bf16") if median else 0.0,
        "exposed_comm_share": exposed,
    }
    tokens = tokens_per_step()
    if tokens is not None and median:
        figures["tokens_per_s_per_gpu"] = tokens / median / max(1, world_size)
    return figures


def _flops_per_s(tflops: float) -> str:
    """TFLOPS in three digits, in the unit that needs no exponent (a tiny model's are MFLOPS)."""
    for unit, scale in (("TFLOPS", 1.0), ("GFLOPS", 1e3), ("MFLOPS", 1e6)):
        if tflops * scale >= 1:
            return f"{tflops * scale:.3g} {unit}"
    return f"{tflops * 1e12:.3g} FLOPS"


def line(rank: int, world_size: int) -> str | None:
    """The end-of-run line of this rank, or None when the clock saw no whole step."""
    clock = clocks.current()
    figures = summary(clock, world_size) if clock is not None else None
    if clock is None or figures is None:
        return None
    steps = len(clock.steps)
    text = (
        f"rank {rank} on {clock.card.name}: predicted step {figures['time_s'] * 1e3:.3g} ms "
        f"(median of {steps} step{'s' if steps != 1 else ''}), {_flops_per_s(figures['tflops'])}, "
        f"MFU {figures['mfu']:.1%}, exposed communication {figures['exposed_comm_share']:.1%} of the step"
    )
    if "tokens_per_s_per_gpu" in figures:
        text += f", {figures['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
    return text


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(path: str, rank: int) -> None:
    """Add this rank's steps to the JSON report at `path` (other ranks of the run add theirs)."""
    clock = clocks.current()
    if clock is None:
        return
    links = ops.links()
    with _locked(path):
        report: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path) as existing:
                report = json.load(existing)
        report.update(
            card=clock.card.name,
            network=f"{links.nic_gbps * 8:g}Gbps",
            gpus_per_node=links.gpus_per_node,
        )
        report.setdefault("ranks", {})[str(rank)] = {"steps": [step.as_json() for step in clock.steps]}
        with open(path + ".tmp", "w") as out:
            json.dump(report, out, indent=1)
        os.replace(path + ".tmp", path)
