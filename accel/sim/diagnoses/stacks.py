"""Python stacks of live ranks, as faulthandler writes them, without the simulator's frames.

Each rank registers faulthandler for SIGUSR1 (and fatal signals) on a per-rank file;
the parent signals the ranks it gives up on and reads what they wrote. Frames of the
rank loop, the fork server and multiprocessing say nothing about the user's code and
are left out.
"""

from __future__ import annotations

import multiprocessing
import os
import re

from accel.sim.runtime import entry

_HIDDEN_IN_STACKS = {
    os.path.join(os.path.dirname(entry.__file__), "worker.py"),
    entry.__file__,
    "<string>",
}
#: (file, function) frames left out: the collective wrapper's bookkeeping, while the
#: wrapper itself stays, named for the collective it runs (e.g. "in all_reduce")
_COLLECTIVES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives.py")
_HIDDEN_FUNCTIONS = {(_COLLECTIVES, "call"), (_COLLECTIVES, "_check")}
_STACK_LINE = re.compile(r'^\s*File "(?P<path>[^"]*)", line \d+ in (?P<function>\S+)')


def hide_in_stacks(path: str) -> None:
    """Leave frames of `path` out of the stacks reported at a timeout (a runner's own file)."""
    _HIDDEN_IN_STACKS.add(path)


def trim_stack(text: str) -> str:
    """A faulthandler dump without the simulator's own frames (rank loop, multiprocessing)."""
    machinery = os.path.dirname(multiprocessing.__file__) + os.sep
    kept = []
    for line in text.splitlines():
        match = _STACK_LINE.match(line)
        if match and (
            match["path"] in _HIDDEN_IN_STACKS
            or match["path"].startswith(machinery)
            or (match["path"], match["function"]) in _HIDDEN_FUNCTIONS
        ):
            continue
        if line.startswith("Extension modules:"):
            continue
        kept.append(line)
    return "\n".join(kept).strip("\n") + "\n" if kept else ""
