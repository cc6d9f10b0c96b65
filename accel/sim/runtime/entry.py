"""The target of a rank process, kept light on purpose.

The parent must hold a reference to the function a rank process starts in; pointing it
here rather than at `accel.sim.runtime.worker` keeps torch out of the parent process (pytest
or `accel launch`), which only orchestrates.

The fork server preloads the heavy modules every rank needs (`PRELOAD`); the rank's own
modules are imported in the rank once coverage, when the parent measures it, has
started, so that their lines count too.
"""

from __future__ import annotations

from typing import Any

#: modules the fork server imports once, so that every rank forked from it starts warm
PRELOAD = ("torch", "torch.distributed", "accel.state")
#: the rank's own modules, also preloaded unless coverage is measured (their lines, those
#: run at import included, then count in every rank)
RANK_MODULES = ("accel.sim.runtime.worker", "accel.sim.devices")


def rank_main(config: dict[str, Any], conn: Any) -> None:
    """Run one rank until the parent says stop (see `accel.sim.runtime.worker.serve`)."""
    from accel.sim.runtime import coverage_support

    coverage = coverage_support.start_in_rank(config.get("coverage"))
    from accel.sim.runtime import worker

    worker.serve(config, conn, coverage)
