"""Install the node's simulated device in a process that has just imported torch.

What a rank of the simulator's own launches gets, less what a launcher gives: the process
sees all N devices of the node and starts on device 0, as a process on a GPU host does; it
makes its own process groups (`init_process_group("nccl", ...)` with any init method or store
is the simulated NCCL group); collectives of the groups it makes are checked across the
group's processes, as under `accel launch` (`accel.sim.diagnoses.collectives`).
"""

from __future__ import annotations

import os
from typing import Any

from accel.sim.node import tree
from accel.sim.node.spec import NodeSpec

_booted: list[NodeSpec] = []


def boot(spec: NodeSpec) -> None:
    """Make this process one of node `spec`'s (once)."""
    if _booted:
        return
    _booted.append(spec)
    from accel.backends import ENV_VAR
    from accel.sim.runtime import adopt_group

    if spec.device == "cuda":
        from accel.sim.cuda import rank

        rank.prepare(local_rank=0, device_count=spec.count)
    else:
        from accel.sim.xla import rank  # type: ignore[no-redef]  # the same protocol

        rank.prepare()
    os.environ[ENV_VAR] = rank.BACKEND
    adopt_group.install(spec.device, rank)
    adopt_group.on_node(_group_created)
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    folder = os.environ.get(tree.NODE_ENV)
    if folder and os.path.isdir(folder):
        tree.register(folder)


def _group_created(store: Any) -> None:
    """A default group exists: check its collectives across its processes, watch them for deadlocks."""
    import torch.distributed as dist

    from accel.sim.diagnoses import collectives
    from accel.sim.node import watchdog

    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = watchdog.group_folder(os.environ[tree.NODE_ENV], store, rank)
    collectives.install(folder, rank, dist.PrefixStore("accel-node-check/", store))
    collectives.begin_task(0, _check_enabled())
    if world_size > 1:
        watchdog.start(folder, rank, world_size)


def _check_enabled() -> bool:
    from accel.sim.runtime.launcher import CHECK_ENV

    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
