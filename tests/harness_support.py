"""Helpers of the harness tests: checking that nothing of a session is left running."""

import os
import signal
import time

from support import process_gone


def is_rank_server(pid: int) -> bool:
    """Whether `pid` is a rank server (`accel.sim.runtime.server`), which outlives sessions by design."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"accel.sim.runtime.server" in handle.read()
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The live child processes of `pid`."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def assert_nothing_left_running(ranks: set[int], parents: set[int]) -> None:
    """Every rank is gone; so is every parent they came from, unless it is a rank server, which
    must then have no child left (it serves the next session; it stops when idle)."""
    leftovers = [pid for pid in ranks if not process_gone(pid)]
    for parent in parents - ranks:
        if is_rank_server(parent):
            deadline = time.monotonic() + 15
            while children(parent) and time.monotonic() < deadline:
                time.sleep(0.05)
            leftovers += children(parent)
        elif not process_gone(parent):
            leftovers.append(parent)
    for pid in leftovers:  # do not leak them into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not leftovers
