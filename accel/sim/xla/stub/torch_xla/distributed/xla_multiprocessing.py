"""`xmp.spawn` of the simulator: each simulated rank already is one of the processes.

A TPU script calls `xmp.spawn(fn, args)` to start one process per core. Under
`accel launch --simulate xla` the launcher has started those processes already, so
`spawn` just runs `fn(ordinal, *args)` in this rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch_xla.runtime as xr


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> None:
    """Run `fn(local_ordinal, *args)` in this simulated rank."""
    if nprocs not in (None, 1, xr.world_size()):
        raise ValueError(
            f"xmp.spawn(nprocs={nprocs}) in a simulated rank: the simulator already started "
            f"{xr.world_size()} processes; choose their number with --num_processes"
        )
    fn(xr.local_ordinal(), *args)
