"""The node's folder and its processes: who created the node, who is still running in it.

The first Python process under `ACCEL_SIMULATE` that finds no node (`ACCEL_SIM_NODE` unset)
creates one: a fresh folder, named in its environment so that every process it starts joins
the same node (the GPUs, their memory and NCCL groups are the node's). Every process of the
node writes its pid and start time there. When the creating process ends, it stops the node's
processes still running (SIGTERM, then SIGKILL after a grace period) and removes the folder:
a command run under the variable leaves nothing behind. A creator that is killed (SIGTERM,
SIGKILL, `os._exit`) runs no exit hook: a small keeper process it starts (`keep`, no torch)
holds a pipe from it and does the same once the pipe closes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from accel.sim import real_time

#: the folder of the node this process is on (inherited by the processes it starts)
NODE_ENV = "ACCEL_SIM_NODE"
#: seconds a leftover process has to end after SIGTERM before it is killed
GRACE = 3.0


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux's /proc), to tell it from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19]  # field 22 of stat: starttime (fields counted after the command name)


def join_or_create() -> tuple[str, bool]:
    """The node's folder, created (and named in the environment) by its first process; whether this one created it."""
    folder = os.environ.get(NODE_ENV)
    created = not folder or not os.path.isdir(folder)
    if created:
        folder = tempfile.mkdtemp(prefix="accel-node-")
        os.environ[NODE_ENV] = folder
        atexit.register(close, folder, os.getpid())
        _start_keeper(folder)
    assert folder is not None
    register(folder)
    return folder, created


def register(folder: str) -> None:
    """Write this process into the node's list of processes."""
    procs = os.path.join(folder, "procs")
    os.makedirs(procs, exist_ok=True)
    pid = os.getpid()
    with open(os.path.join(procs, str(pid)), "w") as handle:
        handle.write(_start_time(pid) or "")


def running(folder: str) -> list[int]:
    """The node's processes still running (this one excluded), by pid."""
    procs = os.path.join(folder, "procs")
    alive = []
    for name in os.listdir(procs) if os.path.isdir(procs) else ():
        pid = int(name)
        with open(os.path.join(procs, name)) as handle:
            started = handle.read()
        if pid != os.getpid() and started and _start_time(pid) == started:
            alive.append(pid)
    return alive


def close(folder: str, owner: int) -> None:
    """Stop the node's processes still running and remove its folder (its creator, at exit)."""
    if os.getpid() != owner:  # a forked child inherits the atexit hook: the node is its parent's
        return
    stop(running(folder))
    shutil.rmtree(folder, ignore_errors=True)


def _start_keeper(folder: str) -> None:
    """A process that closes the node once this one is gone, however it ends (module docstring)."""
    read_end, write_end = os.pipe()
    env = {name: value for name, value in os.environ.items() if name not in ("ACCEL_SIMULATE", NODE_ENV)}
    code = "import sys; from accel.sim.node.tree import keep; keep(int(sys.argv[1]), sys.argv[2])"
    subprocess.Popen(
        [sys.executable, "-c", code, str(read_end), folder],
        pass_fds=(read_end,),
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # out of the command's process group, which may be killed first
    )
    os.close(read_end)
    os.set_inheritable(write_end, False)  # held by this process only: its end closes the pipe
    _keeper_pipe.append(write_end)


#: the write end of the keeper's pipe (kept open for the life of the node's creator)
_keeper_pipe: list[int] = []


def keep(read_end: int, folder: str) -> None:
    """The keeper: wait until the creator's end of the pipe closes, then close the node."""
    with contextlib.suppress(OSError):
        while os.read(read_end, 1):
            pass
    if os.path.isdir(folder):
        stop(running(folder))
        shutil.rmtree(folder, ignore_errors=True)


def stop(pids: list[int]) -> None:
    """SIGTERM each of `pids`, then SIGKILL those still running after `GRACE` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = real_time.monotonic() + GRACE
    while pids and real_time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    # A child of this process that ended is a zombie until reaped: reap it, it is gone.
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return _start_time(pid) is not None and _state(pid) != "Z"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
