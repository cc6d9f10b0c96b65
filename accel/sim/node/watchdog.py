"""A simulated node's processes find their own deadlocks, as a launch's parent finds its ranks'.

Under `accel launch` the parent reads each rank's board (`accel.sim.diagnoses.deadlock`) and
fails ranks that wait in a collective their peers can no longer join. On a node nobody is
their parent, so each process of a group watches the group's boards itself: the group's
processes share a folder (named through the group's store) holding each one's board and pid.
When every live process of the group waits and none of their collectives can complete (the
others exited, or wait in another group's collective), the process says so on stderr, naming
each rank's collective and where it was called, and ends with status 1: as NCCL's watchdog
tears a process down, at once instead of after the group's timeout. Without it, a process
whose peer exited would wait in the collective check for the store's timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
import uuid
from typing import Any

from accel.sim.diagnoses.deadlock import Watch, board_path, describe_wait, read_board

#: seconds between two looks at the boards
PERIOD = 0.2
#: the folder of the group watched now: a watch whose group was replaced ends
_current: list[str] = [""]


def group_folder(node: str, store: Any, rank: int) -> str:
    """The folder the processes of a new group share (created by rank 0, named through `store`)."""
    if rank == 0:
        store.set("accel-node-group", uuid.uuid4().hex)
    folder = os.path.join(node, "groups", store.get("accel-node-group").decode())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    return folder


def start(folder: str, rank: int, world_size: int) -> None:
    """Watch the group's boards from a daemon thread of this process (instead of an earlier group's)."""
    _current[0] = folder
    thread = threading.Thread(target=_watch, args=(folder, rank, world_size), name="accel-node-watchdog", daemon=True)
    thread.start()


def _watch(folder: str, rank: int, world_size: int) -> None:
    watch = Watch(world_size, folder, 0)
    while _current[0] == folder:
        time.sleep(PERIOD)
        if read_board(board_path(folder, rank)) is None:  # this process does not wait: nothing to judge
            continue
        alive = {peer for peer in range(world_size) if _alive(folder, peer)}
        stuck = watch.stuck(sorted(alive), set(range(world_size)) - alive)
        if rank in stuck:
            _report(rank, stuck, set(range(world_size)) - alive)


def _alive(folder: str, rank: int) -> bool:
    """Whether the process of `rank` still runs (a rank not yet written down counts as running)."""
    try:
        with open(os.path.join(folder, f"rank{rank}.pid")) as handle:
            pid = int(handle.read())
    except (OSError, ValueError):
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, 0)
            return True
        return False


def _report(rank: int, stuck: dict[int, dict[str, Any]], exited: set[int]) -> None:
    """Say which collective each rank waits in (this one: where), then end this process."""
    main = sys._current_frames().get(threading.main_thread().ident or 0)
    stack = "".join(traceback.format_stack(main)) if main is not None else ""
    lines = ["accel.sim: deadlock: the processes of this group wait in collectives that can no longer complete"]
    for peer, board in sorted(stuck.items()):
        if peer == rank:
            lines.append(f"  rank {peer} (this process) {describe_wait(board, stack)}")
        else:
            lines.append(
                f"  rank {peer} waits in {board.get('op', 'a collective')} (its collective #{board.get('count')})"
            )
    lines += [f"  rank {peer} has exited" for peer in sorted(exited)]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    os._exit(1)
