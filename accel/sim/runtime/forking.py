"""Where rank processes come from: a process that imported torch and accel once, forking them.

Importing torch takes seconds; forking a process that already did takes milliseconds.
Two such processes, neither a fork of the caller (pytest's threads and state must not
leak into ranks):

- multiprocessing's fork server (the default): a clean process of this session that
  imports a list of modules once, forks a child per request and exits with the session;
- the rank server (`accel.sim.runtime.server`, turned on by `use_server`, as the pytest harness
  does): the same, but it outlives the session, so that the next session (and every
  `pytest -n N` worker of this one) finds torch imported already. A session's ranks
  still end with the session; the server stops when idle, never serves a project
  whose files changed since it imported them, and stops the other idle servers of its
  project (`project_folder`) when it becomes idle itself: at most one idle per project.

`start_rank` starts one rank either way and returns a process handle (pid, sentinel,
exitcode, join) and the parent's end of its connection.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import multiprocessing
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from accel.sim import real_time
from accel.sim.diagnoses import stacks
from accel.sim.runtime import entry

# project_folder and server_directory stay reachable here, where they lived before server_sockets
from accel.sim.runtime.server_sockets import project_folder as project_folder
from accel.sim.runtime.server_sockets import server_directory as server_directory
from accel.sim.runtime.server_sockets import socket_path

# A rank's stack ends in the rank server's frames (it was forked there): machinery, not the user's code.
stacks.hide_in_stacks(os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py"))

#: environment variable turning the rank server off ("0") for the pytest harness
SERVER_ENV = "ACCEL_SIM_SERVER"
#: variables that name one session's moment or start coverage in every interpreter: not
#: part of what a server depends on, and not given to it
_TRANSIENT_PREFIXES = ("PYTEST_", "COV_CORE_")
# ACCEL_SIMULATE/ACCEL_SIM_NODE: a rank server is no process of the node its client is on (its ranks set their own)
_TRANSIENT_NAMES = (
    "COVERAGE_PROCESS_START",
    "PYTHONBREAKPOINT",
    "ACCEL_SIM_SELF_FORK",
    "ACCEL_SIMULATE",
    "ACCEL_SIM_NODE",
)
#: environment variable turning off ("0") the session's own rank server forked from itself
SELF_FORK_ENV = "ACCEL_SIM_SELF_FORK"
#: seconds a request to the rank server may take (its start imports torch)
SERVER_TIMEOUT = float(os.environ.get("ACCEL_SIM_START_TIMEOUT", "120"))
#: bumped when the protocol between client and server changes (2: "stop-if-idle", project-named sockets)
_PROTOCOL = 2


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
        with _off_the_node():
            server.ensure_running()
    return multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def _off_the_node() -> Any:
    """Start a fork server without the simulated node's variables: its ranks are the simulator's, not the node's."""
    saved = {name: os.environ.pop(name) for name in ("ACCEL_SIMULATE", "ACCEL_SIM_NODE") if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


_extra_preload: list[str] = []
_use_server = False


def preload_modules() -> list[str]:
    """The modules ranks find imported (accel.sim.runtime.entry's, and those `add_preload` asked for)."""
    from accel.sim.runtime import coverage_support

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
    """Start ranks from the shared rank server (`accel.sim.runtime.server`) rather than a fork server of
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
    imports torch while the caller goes on (pytest collecting); nothing to do when ranks come
    from this process's own rank server (`fork_session_server`)."""
    if _session is not None and _session_owner == os.getpid():
        return
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
    if _session is not None and _session_owner == os.getpid():
        return _session.start_rank(config)
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


# -- the session's own rank server, forked from this process ---------------------------------

#: native threads of this process right after it imported torch (None: not seen)
_torch_threads: int | None = None


class _TorchImportWatch(importlib.abc.MetaPathFinder):
    """Notes how many native threads this process runs right after torch's import: what its
    import started (one idle thread) is safe to fork over, any thread started later is not."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != "torch":
            return None
        with contextlib.suppress(ValueError):  # once is enough
            sys.meta_path.remove(self)
        # the finders after this one (a simulated node's boot wraps torch's loader too: `accel.sim.node.start`)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WatchedLoader(spec.loader)
        return spec


class _WatchedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        global _torch_threads
        # The module's own loader from now on, as without the watch.
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _torch_threads = _native_threads()


def watch_torch_import() -> None:
    """Start watching for torch's import in this process (the pytest harness does it as it loads)."""
    if "torch" not in sys.modules and not any(isinstance(f, _TorchImportWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportWatch())


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


#: `self_fork_refusal`'s answer while torch is still to be imported (the module being collected may)
NO_TORCH_YET = "torch is not imported in this process"


def self_fork_refusal() -> str:
    """Why this process may not fork itself into a rank server now, or "" when it may."""
    if os.environ.get(SELF_FORK_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{SELF_FORK_ENV}=0"
    if "accel.sim.node.boot" in sys.modules:  # its ranks would inherit the node's devices and groups
        return "this process is on a simulated node (ACCEL_SIMULATE)"
    if not sys.platform.startswith("linux"):
        return "not on Linux"
    if "torch" not in sys.modules:
        if not any(isinstance(finder, _TorchImportWatch) for finder in sys.meta_path):
            return "torch's import is not watched (`watch_torch_import`)"
        return NO_TORCH_YET
    if _torch_threads is None:
        return "torch was imported before accel could watch which threads its import started"
    if threading.active_count() != 1:
        return f"this process runs {threading.active_count()} Python threads"
    native = _native_threads()
    if native != _torch_threads:
        return f"this process runs {native} threads, {_torch_threads} right after importing torch"
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return "this process is traced (coverage, a debugger, a profiler)"
    return ""


_session: ServerClient | None = None
_session_owner = 0
#: why the last `fork_session_server` did not fork
session_refusal = ""
#: the rank server to start when the session ends (key, socket path, sys.path, environment, cwd)
_server_plan: dict[str, Any] | None = None


def session_server_pid() -> int | None:
    """The pid of this process's own rank server (`fork_session_server`), if it runs one."""
    return _session.server_pid if _session is not None and _session_owner == os.getpid() else None


def fork_session_server(own_warning_filters: Sequence[tuple] = ()) -> bool:
    """Fork this process, which imported torch already, into a rank server of this session only.

    The first session of the edit-test loop (no rank server yet, or none wanted, as under
    CI) would otherwise import torch a second time in a fresh server, competing with its
    own import. Only done when safe (`self_fork_refusal`: no thread but this one and
    torch's idle one, nothing tracing); the child drops the session's own set-up
    (`accel.sim.runtime.server.serve_session`), `own_warning_filters` included (pytest's). It ends
    with the session (`end_session`), which then starts the shared rank server for the next
    sessions when one is wanted.
    Returns whether ranks now come from it.
    """
    global _session, _session_owner, session_refusal, _server_plan
    if _session is not None and _session_owner == os.getpid():
        return True
    session_refusal = self_fork_refusal()
    if session_refusal:
        return False
    from accel.sim.runtime import server

    preload = preload_modules()
    plan = _plan_server() if _use_server else None
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        server.serve_session(theirs, preload, {"drop_filters": list(own_warning_filters)})  # never returns
    theirs.close()
    ours.settimeout(SERVER_TIMEOUT)
    _session, _session_owner, _server_plan = ServerClient(ours, pid), os.getpid(), plan
    # A rank's stack ends in the frames this process had when it forked (pytest collecting):
    # machinery, not the user's code, as the rank server's frames are.
    frame: Any = sys._getframe()
    while frame is not None:
        stacks.hide_in_stacks(frame.f_code.co_filename)
        frame = frame.f_back
    return True


def end_session(timeout: float = 10.0) -> None:
    """End this session's own rank server (its ranks with it), then start the shared one for the
    next sessions when wanted (in the background: this session does not wait for its import)."""
    global _session, _server_plan
    if _session is None or _session_owner != os.getpid():
        return
    session, plan = _session, _server_plan
    _session, _server_plan = None, None
    session.close()  # it kills its ranks still running, then exits
    deadline = real_time.monotonic() + timeout
    while os.waitpid(session.server_pid, os.WNOHANG) == (0, 0):
        if real_time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(session.server_pid, 9)
            os.waitpid(session.server_pid, 0)
            break
        time.sleep(0.002)
    if plan is not None:
        with contextlib.suppress(OSError, RuntimeError):  # the next session starts one itself
            _start_planned_server(plan)


def _plan_server() -> dict[str, Any]:
    key = server_key()
    return {
        "key": key,
        "path": socket_path(key),
        "sys_path": list(sys.path),
        "env": server_environment(),
        "cwd": os.getcwd(),
        "preload": preload_modules(),
    }


def _start_planned_server(plan: dict[str, Any]) -> None:
    with _locked(_log_path(plan["path"])):
        sock = _try_connect(plan["path"])
        if sock is not None:  # another session started it meanwhile
            sock.close()
            return
        _spawn(plan["path"], plan["key"], plan, wait=False)


def server_running() -> bool:
    """Whether the rank server of this session's key is there to connect to."""
    if _client is not None and _client_pid == os.getpid():
        return True
    sock = _try_connect(socket_path(server_key()))
    if sock is None:
        return False
    sock.close()
    return True


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
        from accel.sim.runtime.server import decode_status

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

        from accel.sim.runtime import server

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


def server_environment() -> dict[str, str]:
    """The environment a rank server starts with (and is keyed by): ours less the transient variables."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(_TRANSIENT_PREFIXES) and name not in _TRANSIENT_NAMES
    }


def server_key() -> str:
    """What a rank server's preloaded modules depend on, hashed (see `accel.sim.runtime.server`)."""
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
    from accel.sim.runtime import server

    key = server_key()
    path = socket_path(key)
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
        deadline = real_time.monotonic() + SERVER_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if real_time.monotonic() > deadline:
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
    "from accel.sim.runtime.server import main\n"
    "main(sys.argv[2:])\n"
)


def _spawn(path: str, key: str, plan: dict[str, Any] | None = None, wait: bool = True) -> None:
    """Start a rank server listening at `path` (the socket is bound here, so connecting never races it).

    `plan` (`_plan_server`) gives the sys.path, environment, working directory and preload it
    starts with (default: ours now); `wait` False does not wait for it to become a daemon."""
    plan = plan or {"sys_path": sys.path, "env": server_environment(), "cwd": None, "preload": preload_modules()}
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
                    json.dumps(plan["sys_path"]),
                    "serve",
                    "--fd",
                    str(listener.fileno()),
                    "--path",
                    path,
                    "--key",
                    key,
                    "--preload",
                    ",".join(plan["preload"]),
                ],
                pass_fds=(listener.fileno(),),
                env=plan["env"],
                cwd=plan["cwd"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        if not wait:
            # Reaped here next time, or by init once this process exits.
            _detached[:] = [*(proc for proc in _detached if proc.poll() is None), intermediate]
            return
        code = intermediate.wait(SERVER_TIMEOUT)
        if code != 0:
            raise RuntimeError(f"the rank server did not start (exit code {code}); its log:\n{_log_tail(path)}")
    finally:
        listener.close()


#: intermediate processes of servers started without waiting
_detached: list[subprocess.Popen] = []


def reap_detached(timeout: float = 2.0) -> None:
    """At exit: wait for the servers' intermediate processes (each exits once its server is a daemon).

    A Popen object collected before its process was reaped says "subprocess N is still running" even when the
    process has ended; reaped here, it says nothing, and none is left a zombie of this process.
    """
    deadline = real_time.monotonic() + timeout
    for proc in _detached:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(deadline - real_time.monotonic(), 0.0))
    _detached[:] = [proc for proc in _detached if proc.returncode is None]


atexit.register(reap_detached)


def _log_path(path: str) -> str:
    """The log of the server listening at `path` (what it printed, e.g. an import error), also the lock of its start."""
    return path[: -len(".sock")] + ".log"


def _log_tail(path: str) -> str:
    try:
        with open(_log_path(path), "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4000))
            return handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
