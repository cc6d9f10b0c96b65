"""Python's clocks on the simulated GPU host's time (``ACCEL_SIM_CLOCK=gpu``, `accel launch --clock gpu`).

A training loop that times itself with `time.perf_counter` (torchtitan's tokens/s, the Transformers
Trainer's samples/s) measures, in a simulated rank, how long the CPU took to compute it. With the
mode "gpu", `time.perf_counter`, `time.monotonic`, `time.time` and their ``_ns`` variants read
instead where the simulated host is (`clock.Clock.host`: it pays each op's launch and waits where a
GPU host waits, `synchronize` and `.item()` included): each reads its real value at the moment
CUDA started in the rank (`time.time` keeps the epoch), plus the simulated host time since. The
loop's own log then prints the predicted figures.

What keeps real time: the simulator's own timeouts and polling (`accel.sim.real_time`); C code
(torch.distributed's store timeouts, `threading`'s and `queue`'s waits, `datetime.now`); code in
Python's standard library, whose waits loop on `time.monotonic` (`multiprocessing`'s
`connection.wait` and queues, asyncio's event loop: on a clock that stands still while they wait
they would never time out); and any module that bound a function before the mode was installed
(``from time import perf_counter`` at import: tqdm, timeit), which keeps the real one. Time the host
spends outside ops (sleeping, loading data, Python) is not counted, as the clock does not count it;
a loop that waits for simulated time to pass without running ops waits forever (the launch's
timeout still ends it, in real seconds).

Simulated time never runs backwards: a clock that starts again (CUDA starting again in the rank,
another card) continues from where the last one was. The mode is set each time CUDA starts in a
rank (`configure`) and the real functions put back between tasks (`restore`).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

from accel.sim import real_time
from accel.sim.cuda.timing import clock as clocks

#: the values of ``ACCEL_SIM_CLOCK``: no clock; the clock, Python's clocks the machine's; the clock, Python's
#: clocks the simulated GPU host's
OFF, HOST, GPU = "off", "host", "gpu"
_SPELLINGS = {
    OFF: ("off", "0", "false", "no"),
    HOST: ("", "host", "on", "1", "true", "yes"),
    GPU: ("gpu",),
}
#: the functions of `time` replaced in the mode "gpu"
NAMES = ("perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns")


def mode(value: str | None = None) -> str:
    """`OFF`, `HOST` or `GPU`, as `value` (default: ``ACCEL_SIM_CLOCK``) says; ValueError for anything else."""
    given = os.environ.get(clocks.CLOCK_ENV, "") if value is None else value
    spelled = given.strip().lower()
    for name, spellings in _SPELLINGS.items():
        if spelled in spellings:
            return name
    raise ValueError(
        f"{clocks.CLOCK_ENV}={given!r}: use gpu (Python's clocks read the simulated GPU host's time), "
        "host (the machine's time, the default) or off (no simulated clock)"
    )


def _stdlib_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[key], "") for key in ("stdlib", "platstdlib")})


_STDLIB = _stdlib_folders()
#: code file -> whether calls from it read real time (the standard library's)
_real_callers: dict[str, bool] = {}


def _reads_real_time(filename: str) -> bool:
    """Whether code of file `filename` reads real time: the standard library's (not a package installed in it)."""
    real = _real_callers.get(filename)
    if real is None:
        package = "site-packages" in filename or "dist-packages" in filename
        real = not package and (filename.startswith(_STDLIB) or filename.startswith("<frozen"))
        _real_callers[filename] = real
    return real


class _Follower:
    """Simulated seconds since the mode was installed, never decreasing, whatever clock runs.

    No lock (a read costs a few hundred nanoseconds without one): threads reading at once compute the
    same values from the clock's host time, which only grows, and `last` keeps any read from going back.
    """

    def __init__(self) -> None:
        self.clock = clocks.current()
        self.offset = -self.clock.host if self.clock is not None else 0.0  # added to the clock's host time
        self.last = 0.0
        self.bases = {name: getattr(real_time, name)() for name in NAMES}

    def elapsed(self) -> float:
        clock = clocks.current()
        host = clock.host if clock is not None else 0.0
        if clock is not self.clock:  # a clock started again: go on from where the last one was
            self.clock, self.offset = clock, self.last - host
        value = self.offset + host
        if value < self.last:
            value = self.last
        self.last = value
        return value


_follower: list[_Follower] = []


def _replacement(name: str) -> Callable[[], Any]:
    real = getattr(real_time, name)
    in_ns = name.endswith("_ns")

    def read() -> Any:
        caller = sys._getframe().f_back  # None when C code calls it (autograd's threads): getframe(1) would raise
        if not _follower or (caller is not None and _reads_real_time(caller.f_code.co_filename)):
            return real()
        follower = _follower[0]
        elapsed = follower.elapsed()
        base = follower.bases[name]
        return base + round(elapsed * 1e9) if in_ns else base + elapsed

    read.__name__ = read.__qualname__ = name
    read.__doc__ = f"`time.{name}` on the simulated GPU host's time (accel.sim.cuda.timing.pyclock)."
    setattr(read, real_time.REAL_ATTRIBUTE, real)
    return read


_REPLACEMENTS = {name: _replacement(name) for name in NAMES}


def installed() -> bool:
    """Whether `time`'s clocks read the simulated GPU host's time now."""
    return bool(_follower)


def install() -> None:
    """From now on `time`'s clocks read the simulated host's time, from their real values now."""
    if _follower:
        return
    _follower.append(_Follower())
    for name, replacement in _REPLACEMENTS.items():
        setattr(time, name, replacement)


def restore() -> None:
    """`time`'s own clocks again (between tasks of a rank: each task chooses its mode)."""
    _follower.clear()
    for name, replacement in _REPLACEMENTS.items():
        if getattr(time, name) is replacement:  # another patch of `time` (a test's) is left alone
            setattr(time, name, getattr(real_time, name))


def configure() -> None:
    """CUDA started in this rank: follow the simulated host if ``ACCEL_SIM_CLOCK`` says "gpu" and the clock runs."""
    if mode() == GPU and clocks.current() is not None:
        install()  # installed already (CUDA started again): time goes on from where it was
    else:
        restore()
