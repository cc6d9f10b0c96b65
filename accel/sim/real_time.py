"""The machine's own clocks, for the simulator's timeouts, deadlines, watchdogs and polling.

Under ``ACCEL_SIM_CLOCK=gpu`` a simulated GPU rank's `time.perf_counter`, `time.monotonic` and
`time.time` read the simulated GPU host's time (`accel.sim.cuda.timing.pyclock`), which stands
still while the rank waits for a peer. A deadline measured on it would never pass, so the
simulator measures its own waits with the functions here, captured from `time` when this module
is first imported (before any replacement: `pyclock` imports this module first) and unwrapped if a
replacement is found anyway. Torch-free and importing nothing of accel, so that every process of
the simulator (the launcher, the rank and fork servers, a simulated node's processes) can use it.
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable
from typing import TypeVar

_Clock = TypeVar("_Clock", Callable[[], float], Callable[[], int])

#: the attribute a replacement of a `time` function carries: the real function it replaced
REAL_ATTRIBUTE = "__accel_real__"


def _real(function: _Clock) -> _Clock:
    return getattr(function, REAL_ATTRIBUTE, function)


#: seconds, as `time.monotonic` reads them on this machine
monotonic: Callable[[], float] = _real(_time.monotonic)
#: seconds, as `time.perf_counter` reads them on this machine
perf_counter: Callable[[], float] = _real(_time.perf_counter)
#: seconds since the epoch, as `time.time` reads them on this machine
time: Callable[[], float] = _real(_time.time)
monotonic_ns: Callable[[], int] = _real(_time.monotonic_ns)
perf_counter_ns: Callable[[], int] = _real(_time.perf_counter_ns)
time_ns: Callable[[], int] = _real(_time.time_ns)
