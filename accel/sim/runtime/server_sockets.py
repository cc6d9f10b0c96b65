"""Where rank servers listen: this user's private socket folder, and one socket per server
named ``<project>-<key>.sock``, so that a server finds the other servers of its project by
name alone. Shared by the rank server (`accel.sim.runtime.server`) and its clients
(`accel.sim.runtime.forking`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile


def server_directory() -> str:
    """This user's folder of rank server sockets (private to the user)."""
    path = os.path.join(tempfile.gettempdir(), f"accel-sim-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    stat = os.stat(path)
    if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
        raise RuntimeError(f"{path} must belong to this user and be private to it (mode 700)")
    return path


def project_folder() -> str:
    """The project a session works on: the top level of the git work tree holding the working
    directory (the nearest folder at or above it with a `.git`), else the working directory.

    The rank servers of one project bound each other (`accel.sim.runtime.server`: at most one of
    them idle), whichever subfolder, interpreter or environment each session ran with.
    """
    start = os.path.realpath(os.getcwd())
    folder = start
    while not os.path.exists(os.path.join(folder, ".git")):
        parent = os.path.dirname(folder)
        if parent == folder:  # the root, and no work tree above: the working directory alone
            return start
        folder = parent
    return folder


def socket_path(key: str) -> str:
    """Where the rank server of `key` listens: ``<project>-<key>.sock`` in `server_directory`.

    The project (`project_folder`, hashed) comes first so that a server finds the other servers
    of its project by name alone (`sibling_sockets`)."""
    project = hashlib.sha256(project_folder().encode()).hexdigest()[:16]
    return os.path.join(server_directory(), f"{project}-{key[:32]}.sock")


def sibling_sockets(path: str) -> list[str]:
    """The sockets of the other servers of the project of the server listening at `path`: those
    of its folder whose name starts with the same project hash (``<project>-<key>.sock``)."""
    folder, name = os.path.split(path)
    project, dash, _ = name.partition("-")
    if not dash:
        return []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [
        os.path.join(folder, other)
        for other in sorted(names)
        if other != name and other.startswith(project + dash) and other.endswith(".sock")
    ]
