"""The clock of a simulated GPU rank: when its host issues each kernel, when each stream runs it.

As on a GPU host, the host runs ahead of the GPU: each op costs the host a launch (`HOST_OP_S`), and
its kernel starts on its stream when the stream is free, not before the host issued it. Streams wait
for events and for each other (`wait`); the host waits for the GPU only where a GPU host waits
(`host_waits`: `synchronize`, `.item()`, blocking copies). Collectives run on a stream of their own
per group, after what the issuing stream had queued (`collective`). A step is the time between two
returns of the first optimizer's `step()`, on the GPU's clock: when the work issued by then is done.

One `Clock` per rank process, started with CUDA (`start`), for every simulated GPU of the process.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from accel.sim.cuda.gpus import cards
from accel.sim.cuda.gpus.cards import GpuModel

#: ``ACCEL_SIM_CLOCK``: "off" stops the clock (it runs in every simulated GPU rank otherwise)
CLOCK_ENV = "ACCEL_SIM_CLOCK"
#: what the host pays to issue one op that launches a kernel (Python, torch's dispatcher, the launch), seconds:
#: eager PyTorch's per-op overhead is a few microseconds to ~10 on current hosts
HOST_OP_S = 6e-6
#: what the host pays for an op that launches nothing (a view, an allocation)
HOST_VIEW_S = 2e-6
#: what the host pays to issue one collective (c10d's bookkeeping, NCCL's enqueue)
HOST_COLLECTIVE_S = 15e-6


@dataclasses.dataclass
class Step:
    """One training step on this rank's GPUs, in seconds of simulated time."""

    time_s: float
    compute_s: float  # time some compute kernel ran
    comm_s: float  # time some collective ran
    exposed_comm_s: float  # time a collective ran and no compute kernel did
    flops: int

    def as_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where the disjoint sorted spans `a` and `b` overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if high > low:
            total += high - low
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class Clock:
    """Simulated time of one rank's host and of each (GPU, stream) it issues work to."""

    def __init__(self, card: GpuModel) -> None:
        self.card = card
        self.host = 0.0
        #: (gpu, stream id) -> when the last kernel issued to it ends
        self.free: dict[tuple[int, Any], float] = {}
        #: this step's kernels: (start, end, is a collective, name, (gpu, stream))
        self.spans: list[tuple[float, float, bool, str, Any]] = []
        #: the last whole step: (begin, end, its kernels), for a trace of it
        self.last: tuple[float, float, list[tuple[float, float, bool, str, Any]]] | None = None
        self.flops = 0
        self.boundary: float | None = None  # GPU time at the last step's end
        self.steps: list[Step] = []
        self.stepper: int | None = None  # id of the optimizer whose steps mark the boundaries
        #: what names where a kernel comes from (a module, an autograd node), while a trace is asked for
        self.namer: Any = None
        #: gpu -> its latest collectives: (start, end, the link that bounds it, its NCCL stream)
        self.collectives: dict[int, list[tuple[float, float, str, Any]]] = {}

    def ready(self, gpu: int, stream: Any) -> float:
        """When work issued now on (gpu, stream) could start: an event recorded now completes then."""
        free = self.free.get((gpu, stream), 0.0)
        return free if free > self.host else self.host

    def launch(
        self, gpu: int, stream: Any, seconds: float, flops: int = 0, comm: bool = False, name: str = ""
    ) -> float:
        """Issue kernel `name` of `seconds` on (gpu, stream); returns when it ends."""
        key = (gpu, stream)
        free = self.free.get(key, 0.0)
        start = free if free > self.host else self.host
        end = start + seconds
        self.free[key] = end
        self.host += HOST_COLLECTIVE_S if comm else HOST_OP_S
        if self.namer is not None:
            where = self.namer()
            name = f"{name} ({where})" if where else name
        self.spans.append((start, end, comm, name, key))
        self.flops += flops
        return end

    def gpu_state(self) -> tuple[dict, int, int]:
        """What the GPUs have run so far (streams' ends, kernels, FLOPs), for `rewind_gpus`."""
        return dict(self.free), len(self.spans), self.flops

    def rewind_gpus(self, state: tuple[dict, int, int]) -> None:
        """The GPUs back to `state`, the host's time kept: work issued since ran nowhere (a CUDA graph's capture)."""
        free, spans, flops = state
        self.free = free
        del self.spans[spans:]
        self.flops = flops

    def issue_only(self) -> None:
        """An op that launches no kernel: the host's cost alone."""
        self.host += HOST_VIEW_S

    def wait(self, gpu: int, stream: Any, until: float) -> None:
        """(gpu, stream) runs nothing issued from now on before `until` (an event, another stream, a collective)."""
        key = (gpu, stream)
        if self.free.get(key, 0.0) < until:
            self.free[key] = until

    def host_waits(self, until: float) -> None:
        """The host blocks until GPU time `until`."""
        if self.host < until:
            self.host = until

    def drained(self, gpu: int | None = None) -> float:
        """When every stream of `gpu` (None: of every GPU) has finished what was issued to it."""
        ends = [end for (index, _), end in self.free.items() if gpu is None or index == gpu]
        return max(ends, default=0.0)

    def optimizer_stepped(self, optimizer: Any) -> None:
        """`optimizer.step()` returned: the first optimizer to step marks where each step ends."""
        if self.stepper is None:
            self.stepper = id(optimizer)
        if id(optimizer) == self.stepper:
            self.end_step()

    def end_step(self) -> None:
        """A step ends here, in the host's issue order: once the GPUs finish what was issued so far."""
        end = max(self.drained(), self.boundary or 0.0)
        if self.boundary is not None:
            self.steps.append(self._account(self.boundary, end))
            self.last = (self.boundary, end, self.spans)
        self.boundary = end
        self.spans = []
        self.flops = 0

    def _account(self, begin: float, end: float) -> Step:
        compute = _union([(max(s, begin), e) for s, e, comm, _, _ in self.spans if not comm and e > begin])
        comms = _union([(max(s, begin), e) for s, e, comm, _, _ in self.spans if comm and e > begin])
        comm_s = sum(e - s for s, e in comms)
        return Step(
            time_s=end - begin,
            compute_s=sum(e - s for s, e in compute),
            comm_s=comm_s,
            exposed_comm_s=comm_s - _overlap(compute, comms),
            flops=self.flops,
        )


_clock: list[Clock] = []


def enabled() -> bool:
    """Whether simulated GPU ranks keep the clock (``ACCEL_SIM_CLOCK`` other than "off")."""
    return os.environ.get(CLOCK_ENV, "").strip().lower() not in ("off", "0", "false", "no")


def start(card: GpuModel | None = None) -> Clock | None:
    """Start this rank's clock at zero on `card` (default: the card ``ACCEL_SIM_GPU`` names); None when off."""
    _clock.clear()
    if not enabled():
        return None
    _clock.append(Clock(card if card is not None else cards.resolve()))
    return _clock[0]


def stop() -> None:
    _clock.clear()


def current() -> Clock | None:
    """This rank's clock, if it runs."""
    return _clock[0] if _clock else None
