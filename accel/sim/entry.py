"""The target of a rank process, kept light on purpose.

The parent must hold a reference to the function a rank process starts in; pointing it
here rather than at `accel.sim.worker` keeps torch out of the parent process (pytest
or `accel launch`), which only orchestrates. The fork server preloads the heavy module.
"""

from __future__ import annotations

from typing import Any

#: module the fork server imports once, so that every rank forked from it starts warm
WORKER_MODULE = "accel.sim.worker"


def rank_main(config: dict[str, Any], conn: Any) -> None:
    """Run one rank until the parent says stop (see `accel.sim.worker.serve`)."""
    from accel.sim import worker

    worker.serve(config, conn)
