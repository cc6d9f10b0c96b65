"""Where rank processes come from: a process that imported torch and accel once, forking them.

Importing torch takes seconds; forking a process that already did takes milliseconds.
Two such processes, neither a fork of the caller (pytest's threads and state must not
leak into ranks):

- multiprocessing's fork server (the default): a clean process of this session that
  imports a list of modules once, forks a child per request and exits with the session;
- the rank server (`accel.sim.server`, turned on by `use_server`, as the pytest harness
  does): the same, but it outlives the session, so that the next session (and every
  `pytest -n N` worker of this one) finds torch imported already. A session's ranks
  still end with the session; the server stops when idle, and never serves a project
  whose files changed since it imported them.

`start_rank` starts one rank either way and returns a process handle (pid, sentinel,
exitcode, join) and the parent's end of its connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from accel.sim import entry, stacks

# A rank's stack ends in the rank server's frames (it was forked there): machinery, not the user's code.
stacks.hide_in_stacks(os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py"))

#: environment variable turning the rank server off ("0") for the pytest harness
SERVER_ENV = "ACCEL_SIM_SERVER"
#: variables that name one session's moment or start coverage in every interpreter: not
#: part of what a server depends on, and not given to it
_TRANSIENT_PREFIXES = ("PYTEST_", "COV_CORE_")
_TRANSIENT_NAMES = ("COVERAGE_PROCESS_START", "PYTHONBREAKPOINT")
#: seconds a request to the rank server may take (its start imports torch)
SERVER_TIMEOUT = float(os.environ.get("ACCEL_SIM_START_TIMEOUT", "120"))
#: bumped when the protocol between client and server changes
_PROTOCOL = 1


def context() -> Any:
    """The fork-server context, preloading the rank module when the server is not up yet."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the only way to add to the preload list
    if getattr(server, "_forkserver_pid", None) is None:
        wanted = list(getattr(server, "_preload_modules", ["__main__"]))
        for name in preload_modules():
            if name not in wanted:
                wanted.append(name)
        server.set_forkserver_preload(wanted)
    return multiprocessing.get_context("forkserver")


_extra_preload: list[str] = []
_use_server = False


def preload_modules() -> list[str]:
    """The modules ranks find imported (accel.sim.entry's, and those `add_preload` asked for)."""
    from accel.sim import coverage_support

    names = list(entry.PRELOAD)
    if coverage_support.parent_settings() is None:
        names += entry.RANK_MODULES
    names += [name for name in _extra_preload if name not in names]
    return names


def add_preload(*modules: str) -> None:
    """Ask the fork server to import `modules` too (before it starts; e.g. the pytest harness)."""
    for name in modules:
        if name not in _extra_preload:
            _extra_preload.append(name)


def use_server(on: bool = True) -> bool:
    """Start ranks from the shared rank server (`accel.sim.server`) rather than a fork server of
    this process; returns the previous choice."""
    global _use_server
    previous, _use_server = _use_server, on
    return previous


def server_wanted() -> bool:
    """Whether the environment asks for the rank server (ACCEL_SIM_SERVER; default on, except
    under CI, where no next session would find it: CI set to anything but "" / "0" / "false")."""
    under_ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    value = os.environ.get(SERVER_ENV, "0" if under_ci else "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"{SERVER_ENV}={value!r}: use 1 (share a rank server between sessions, the default) or 0")


def warm_up() -> None:
    """Start the fork server (or reach the rank server) now, in the background, so that it
    imports torch while the caller goes on (pytest collecting)."""
    if _use_server:
        threading.Thread(target=_warm_client, name="accel-sim-server-connect", daemon=True).start()
        return
    context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _warm_client() -> None:
    # Errors are not lost: the first rank start asks again and raises them.
    with contextlib.suppress(Exception):
        client()


def start_rank(config: dict[str, Any]) -> tuple[Any, Any]:
    """Start one rank running `entry.rank_main(config, conn)`: (process handle, parent's end of conn)."""
    if _use_server:
        return client().start_rank(config)
    ctx = context()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=entry.rank_main, args=(config, child_end), name=f"accel-sim-rank{config['rank']}")
    try:
        proc.start()
    finally:
        child_end.close()
    return proc, parent_end


# -- the rank server, client side -----------------------------------------------------------


class RankProcess:
    """A rank forked by the rank server, seen from the client (what the pool uses of a Process)."""

    def __init__(self, pid: int, sentinel: int) -> None:
        self.pid = pid
        #: readable once the rank has exited (the server writes its exit code there)
        self.sentinel = sentinel
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and self.sentinel >= 0:
            self.join(0)
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self._exitcode is not None or self.sentinel < 0:
            return
        readable, _, _ = select.select([self.sentinel], [], [], timeout)
        if not readable:
            return
        from accel.sim.server import decode_status

        data = os.read(self.sentinel, 8)
        # No status: the server died without reaping it; the rank died with it (SIGKILL).
        self._exitcode = decode_status(data) if len(data) == 8 else -9

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def __repr__(self) -> str:
        return f"RankProcess(pid={self.pid}, exitcode={self._exitcode})"


class ServerClient:
    """This process's connection to a rank server; the ranks it asks for end when it closes."""

    def __init__(self, sock: socket.socket, server_pid: int) -> None:
        self.sock = sock
        self.server_pid = server_pid
        self._lock = threading.Lock()

    def start_rank(self, config: dict[str, Any]) -> tuple[RankProcess, Any]:
        from multiprocessing.connection import Connection

        from accel.sim import server

        parent, child = socket.socketpair()
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                server.send(self.sock, ("fork", config), fds=(child.fileno(), status_w))
                reply, _ = server.receive(self.sock)
        except (OSError, EOFError) as error:
            parent.close()
            os.close(status_r)
            raise RuntimeError(f"the rank server (pid {self.server_pid}) did not start a rank: {error!r}") from error
        finally:
            child.close()
            os.close(status_w)
        if reply[0] != "forked":
            parent.close()
            os.close(status_r)
            raise RuntimeError(f"the rank server (pid {self.server_pid}) did not start a rank: {reply[1]}")
        return RankProcess(reply[1], status_r), Connection(parent.detach())

    def close(self) -> None:
        self.sock.close()


_client: ServerClient | None = None
_client_pid = 0
_client_lock = threading.Lock()


def client() -> ServerClient:
    """This process's connection to the rank server of its key, started when there is none."""
    global _client, _client_pid
    with _client_lock:
        if _client is None or _client_pid != os.getpid():
            _client = _connect()
            _client_pid = os.getpid()
        return _client


def server_directory() -> str:
    """This user's folder of rank server sockets (private to the user)."""
    path = os.path.join(tempfile.gettempdir(), f"accel-sim-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    stat = os.stat(path)
    if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
        raise RuntimeError(f"{path} must belong to this user and be private to it (mode 700)")
    return path


def server_environment() -> dict[str, str]:
    """The environment a rank server starts with (and is keyed by): ours less the transient variables."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(_TRANSIENT_PREFIXES) and name not in _TRANSIENT_NAMES
    }


def server_key() -> str:
    """What a rank server's preloaded modules depend on, hashed (see `accel.sim.server`)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return ""

    parts = {
        "protocol": _PROTOCOL,
        "executable": sys.executable,
        "python": sys.version,
        "sys_path": sys.path,
        "cwd": os.getcwd(),
        "environment": sorted(server_environment().items()),
        "preload": preload_modules(),
        "versions": [version("torch"), version("accel")],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _connect() -> ServerClient:
    from accel.sim import server

    key = server_key()
    path = os.path.join(server_directory(), f"{key[:32]}.sock")
    why = ""
    for _ in range(3):
        sock = _try_connect(path)
        if sock is None:
            with _locked(_log_path(path)):
                sock = _try_connect(path)
                if sock is None:
                    _spawn(path, key)
                    sock = _try_connect(path)
            if sock is None:
                raise RuntimeError(f"could not connect to the rank server just started at {path}")
        sock.settimeout(SERVER_TIMEOUT)
        try:
            server.send(sock, ("hello", key))
            reply, _ = server.receive(sock)
        except TimeoutError as error:
            sock.close()
            raise RuntimeError(
                f"the rank server at {path} did not answer within {SERVER_TIMEOUT:g} s; its log:\n{_log_tail(path)}"
            ) from error
        except (OSError, EOFError) as error:
            # It exited meanwhile (idle, stopped) or failed to start: try again, then say why.
            sock.close()
            why = f"{error!r}; its log:\n{_log_tail(path)}"
            continue
        if reply[0] == "ok":
            sock.settimeout(SERVER_TIMEOUT)
            return ServerClient(sock, reply[1])
        sock.close()
        why = reply[1]  # it removed its socket: the next attempt starts a fresh server
    raise RuntimeError(f"no rank server would serve this session at {path}: {why}")


def _try_connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


@contextlib.contextmanager
def _locked(path: str) -> Any:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + SERVER_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"waited {SERVER_TIMEOUT:g} s for the lock {path}") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


#: started in the server: becomes a daemon (not our child), then serves
_SERVER_MAIN = (
    "import json, os, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "from accel.sim.server import main\n"
    "main(sys.argv[2:])\n"
)


def _spawn(path: str, key: str) -> None:
    """Start a rank server listening at `path` (the socket is bound here, so connecting never races it)."""
    with contextlib.suppress(FileNotFoundError):  # a dead server's
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(path)
        listener.listen(64)
        with open(_log_path(path), "ab") as log:
            intermediate = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _SERVER_MAIN,
                    json.dumps(sys.path),
                    "serve",
                    "--fd",
                    str(listener.fileno()),
                    "--path",
                    path,
                    "--key",
                    key,
                    "--preload",
                    ",".join(preload_modules()),
                ],
                pass_fds=(listener.fileno(),),
                env=server_environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        code = intermediate.wait(SERVER_TIMEOUT)
        if code != 0:
            raise RuntimeError(f"the rank server did not start (exit code {code}); its log:\n{_log_tail(path)}")
    finally:
        listener.close()


def _log_path(socket_path: str) -> str:
    """The server's log (what it printed, e.g. an import error), also the lock of its start."""
    return socket_path[: -len(".sock")] + ".log"


def _log_tail(path: str) -> str:
    try:
        with open(_log_path(path), "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4000))
            return handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
