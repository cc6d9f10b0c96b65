"""The fork server every rank process is forked from, with torch and accel preloaded.

Importing torch takes seconds; forking a process that already did takes milliseconds.
multiprocessing's fork server is a clean process (not a fork of pytest, whose threads
and state must not leak into ranks) that imports a list of modules once and then forks
a child per request, handing it the pipes it needs.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from accel.sim import entry


def context() -> Any:
    """The fork-server context, preloading the rank module when the server is not up yet."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the only way to add to the preload list
    if getattr(server, "_forkserver_pid", None) is None:
        wanted = list(getattr(server, "_preload_modules", ["__main__"]))
        for name in (*entry.PRELOAD, *_extra_preload):
            if name not in wanted:
                wanted.append(name)
        server.set_forkserver_preload(wanted)
    return multiprocessing.get_context("forkserver")


_extra_preload: list[str] = []


def add_preload(*modules: str) -> None:
    """Ask the fork server to import `modules` too (before it starts; e.g. the pytest harness)."""
    for name in modules:
        if name not in _extra_preload:
            _extra_preload.append(name)


def warm_up() -> None:
    """Start the fork server now, so that it imports torch while the caller goes on (pytest collecting)."""
    context()
    from multiprocessing import forkserver

    forkserver.ensure_running()
