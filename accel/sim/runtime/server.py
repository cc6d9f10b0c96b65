"""A rank server: one process that imported torch and accel once, forking rank processes on request,
and outliving the pytest session that started it, so that the next session finds it warm.

Importing torch takes seconds; every `pytest` run of the edit-test loop would pay it again
in a fresh fork server. A rank server is shared instead, by the sessions that run one
after the other and by the `pytest -n N` workers of a session, on these terms:

- **Keyed.** Its socket's name is a hash of what the preloaded modules depend on: the
  interpreter and its version, sys.path, the working directory, the environment (less the
  variables that name one session's moment: PYTEST_*, coverage's start-up variables) and
  the modules to preload. Sessions that differ in any of these get different servers.
- **Bounded: at most one idle server per project.** The name starts with a hash of the
  project (`accel.sim.runtime.server_sockets.project_folder`: the git work tree of the working
  directory, else that directory): ``<project>-<key>.sock``. Whenever a server becomes
  idle (as it starts, and each time its last client left and its ranks are gone), it asks
  the other servers of its project to stop if idle (``stop-if-idle``); one stops only when
  it has no client and no rank and became idle earlier than the asker, so that the most
  recently used one stays (of two that became idle at once, exactly one). A server in use
  refuses, and asks in its turn once it becomes idle. So a project has at most one idle
  server (about 230 MB), plus one per environment its running sessions use.
- **Never serving a changed project.** The server records the files of every module it
  imported (outside the standard library: accel, harness, torch, ...) with their sizes and
  modification times; each client's hello re-checks them, and a server whose files
  changed refuses, removes its socket and exits once its ranks are gone. The client then
  starts a fresh one.
- **Clean and safe forks.** The server is a fresh interpreter (not a fork of pytest), runs
  one thread (it refuses to fork otherwise), and each rank closes every descriptor of the
  server's before it runs; ranks set themselves up from the client's configuration
  (environment, coverage, working directory and sys.path per task), as before.
- **Nothing of a session left running.** Ranks belong to the client connection that asked
  for them: when it closes (the session ended, crashed or was killed) the server kills
  those still running (their whole process groups). Ranks die with the server (parent-death
  signal). The server itself exits after `IDLE_TIMEOUT` seconds without clients
  (``ACCEL_SIM_SERVER_IDLE``), or when told to (``python -m accel.sim.runtime.server stop``).
- **Exit statuses.** The server reaps its ranks and writes each one's exit code to a pipe
  the client holds (the rank's sentinel), so that deaths and signals are reported as
  before.

The protocol (one stream connection per client, length-prefixed pickles of plain tuples,
descriptors passed alongside with SCM_RIGHTS): ``("hello", key)`` -> ``("ok", pid)`` or
``("refused", why)``; ``("fork", config)`` with the rank's connection and the write end of
its status pipe -> ``("forked", pid)`` or ``("error", text)``; ``("kill", pid)``; ``("stop",)``;
``("stop-if-idle", idle_since, pid)`` (from another server of the project; no answer).
Client side: `accel.sim.runtime.forking`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import sysconfig
import traceback
from typing import Any

from accel.sim import real_time
from accel.sim.runtime.server_sockets import server_directory, sibling_sockets

#: seconds a server waits without clients before it exits
IDLE_TIMEOUT = float(os.environ.get("ACCEL_SIM_SERVER_IDLE", "900"))
_HEADER = struct.Struct("!Q")
_STATUS = struct.Struct("!q")
#: descriptors a fork request carries: the rank's connection, the write end of its status pipe
_FORK_FDS = 2


# -- framing (both sides) -----------------------------------------------------------------


def send(sock: socket.socket, message: tuple, fds: tuple[int, ...] = ()) -> None:
    """Send one message (a pickled tuple), with `fds` passed alongside."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
        sock.sendall(data)
    else:
        sock.sendall(header + data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[tuple, list[int]]:
    """One message and the descriptors that came with it; EOFError when the peer closed."""
    header, fds = b"", list[int]()
    while len(header) < _HEADER.size:
        if max_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, _HEADER.size - len(header), max_fds)
        else:
            chunk = sock.recv(_HEADER.size - len(header))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise EOFError("the peer closed the connection")
        header += chunk
    (size,) = _HEADER.unpack(header)
    view = bytearray(size)
    got = 0
    while got < size:
        count = sock.recv_into(memoryview(view)[got:])
        if not count:
            raise EOFError("the peer closed the connection in the middle of a message")
        got += count
    return pickle.loads(view), fds


def decode_status(data: bytes) -> int:
    """A rank's exit code as the server wrote it (negative: killed by that signal)."""
    (code,) = _STATUS.unpack(data)
    return code


# -- the server ---------------------------------------------------------------------------


def module_files() -> dict[str, tuple[int, int]]:
    """(mtime, size) of the file of every imported module outside the standard library."""
    stdlib = tuple(os.path.realpath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "platstdlib"))
    files: dict[str, tuple[int, int]] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or path in files:
            continue
        real = os.path.realpath(path)
        if real.startswith(stdlib) and "site-packages" not in real:
            continue
        try:
            stat = os.stat(path)
        except OSError:
            files[path] = (-1, -1)
            continue
        files[path] = (stat.st_mtime_ns, stat.st_size)
    return files


def changed_files(recorded: dict[str, tuple[int, int]]) -> list[str]:
    """Files of `recorded` whose size or modification time differ now."""
    changed = []
    for path, (mtime, size) in recorded.items():
        try:
            stat = os.stat(path)
            now = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            now = (-1, -1)
        if now != (mtime, size):
            changed.append(path)
    return changed


class _Rank:
    def __init__(self, client: socket.socket, status_fd: int) -> None:
        self.client = client
        self.status_fd = status_fd


class Server:
    """The server's loop (see the module docstring)."""

    def __init__(
        self, listener: socket.socket | None, path: str, key: str, idle: float, record_files: bool = True
    ) -> None:
        #: None: a session's own server (`serve_session`), serving the one client it was forked with
        self.listener = listener
        if listener is not None:  # `_accept` takes what is waiting, and never waits
            listener.setblocking(False)
        self.path = path
        self.key = key
        self.idle = idle
        self.clients: dict[socket.socket, set[int]] = {}
        self.ranks: dict[int, _Rank] = {}
        self.accepting = True
        #: when the last client left (the idle time counts from then)
        self.last_active = real_time.monotonic()
        #: clients that said hello and were served: sessions (not other servers asking it to stop)
        self.sessions: set[socket.socket] = set()
        #: when it became idle (no session, no rank; real_time.monotonic, one clock for the whole
        #: machine, compared with other servers'); None while in use
        self.idle_since: float | None = self.last_active
        #: whether this idle spell was announced to the project's other servers (`_stop_idle_siblings`)
        self.announced = False
        self.files = module_files() if record_files else {}
        #: threads after the preload (torch's library starts one idle native thread)
        self.native_threads = _native_threads()
        try:
            self.inode: int | None = os.stat(path).st_ino
        except OSError:
            self.inode = None
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the pipe
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the sessions'
        if self.listener is not None:
            self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        while True:
            self._note_idle()
            self._stop_idle_siblings()
            if self.clients or self.ranks:
                timeout = None
            else:
                if not self.accepting:
                    return
                timeout = self.last_active + self.idle - real_time.monotonic()
                if timeout <= 0:
                    return
            events = self.selector.select(timeout)
            for key, _ in events:
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 512):
                            pass
                    self._reap()
                else:
                    self._serve_client(key.fileobj)  # type: ignore[arg-type]  # registered sockets only
            self._reap()

    def _accept(self) -> bool:
        """Accept a client waiting to connect; whether there was one (the listener does not block)."""
        if self.listener is None:
            return False
        try:
            client, _ = self.listener.accept()
        except OSError:
            return False
        client.setblocking(True)
        self.clients[client] = set()
        self.selector.register(client, selectors.EVENT_READ)
        return True

    def _serve_client(self, client: socket.socket) -> None:
        try:
            message, fds = receive(client, max_fds=_FORK_FDS)
        except (EOFError, OSError):
            self._drop(client)
            return
        try:
            kind = message[0]
            if kind == "hello":
                self._hello(client, message[1])
            elif kind == "fork":
                self._fork(client, message[1], fds)
                fds = []
            elif kind == "kill":
                if message[1] in self.clients[client]:
                    _kill(message[1])
            elif kind == "stop-if-idle":
                self._stop_if_idle(client, message[1], message[2])
            elif kind == "stop":
                self._stop_accepting()
                for pid in list(self.ranks):
                    _kill(pid)
                self._drop(client)
            else:
                raise ValueError(f"unknown request {kind!r}")
        except (OSError, EOFError):
            self._drop(client)
        finally:
            for fd in fds:
                os.close(fd)

    def _hello(self, client: socket.socket, key: str) -> None:
        changed = changed_files(self.files)
        if key != self.key:
            send(client, ("refused", f"this server serves key {self.key}, not {key}"))
        elif changed:
            self._stop_accepting()
            send(client, ("refused", f"{len(changed)} imported file(s) changed since it started, e.g. {changed[0]}"))
        elif not self.accepting:
            send(client, ("refused", "this server is stopping"))
        else:
            # In use: idle again once no session is left and their ranks are gone (`_note_idle`).
            self.sessions.add(client)
            self.idle_since = None
            send(client, ("ok", os.getpid()))

    def _stop_idle_siblings(self) -> None:
        """Once per idle spell, ask the project's other servers to stop if idle: this one, the
        last used, stays warm for the project's next session, and at most one idle server per
        project is left."""
        if self.idle_since is None or self.announced or not self.accepting or self.listener is None:
            return
        self.announced = True
        for path in sibling_sockets(self.path):
            with socket.socket(socket.AF_UNIX) as sock:
                # The message is a few bytes: it fits the socket's buffer, so no wait on a busy sibling
                # (the timeout is for a full backlog); no answer is awaited, so two asking each other
                # at once cannot deadlock.
                sock.settimeout(1.0)
                with contextlib.suppress(OSError):  # gone, or stopping: nothing to stop
                    sock.connect(path)
                    send(sock, ("stop-if-idle", self.idle_since, os.getpid()))

    def _stop_if_idle(self, asker: socket.socket, their_idle_since: float, their_pid: int) -> None:
        """Another server of the project became idle: stop unless in use or idle since later than it.

        In use means a rank or a client other than the asker (one that connected but did not say
        hello yet is about to use this server). Of two idle servers, the one idle since earlier
        stops (pid as the tie-break), so that two asking each other at once do not both stop."""
        while self._accept():  # clients that connected before this request count: never stopped under them
            pass
        in_use = bool(self.ranks) or any(other is not asker for other in self.clients)
        mine = self.idle_since
        if not in_use and mine is not None and (mine, os.getpid()) < (their_idle_since, their_pid):
            self._stop_accepting()
        self._drop(asker)

    def _note_idle(self) -> None:
        """Note when the last session and rank went (what `_stop_if_idle` compares), to be announced."""
        if self.idle_since is None and not self.sessions and not self.ranks:
            self.idle_since = real_time.monotonic()
            self.announced = False

    def _fork(self, client: socket.socket, config: dict[str, Any], fds: list[int]) -> None:
        if len(fds) != _FORK_FDS:
            for fd in fds:
                os.close(fd)
            send(client, ("error", f"a fork request carries {_FORK_FDS} descriptors, got {len(fds)}"))
            return
        unsafe = _unsafe_threads(self.native_threads)
        if unsafe:
            for fd in fds:
                os.close(fd)
            send(client, ("error", f"the rank server {unsafe}: forking it would not be safe"))
            return
        conn_fd, status_fd = fds
        pid = os.fork()
        if pid == 0:
            self._child(conn_fd, status_fd, config)
        os.close(conn_fd)
        self.ranks[pid] = _Rank(client, status_fd)
        self.clients[client].add(pid)
        send(client, ("forked", pid))

    def _child(self, conn_fd: int, status_fd: int, config: dict[str, Any]) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.selector.close()
            if self.listener is not None:
                self.listener.close()
            for client in self.clients:
                client.close()
            for rank in self.ranks.values():
                os.close(rank.status_fd)
            for fd in (status_fd, self.wake_r, self.wake_w):
                os.close(fd)
            from multiprocessing.connection import Connection

            from accel.sim.runtime import entry

            entry.rank_main(config, Connection(conn_fd))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)

    def _reap(self) -> None:
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rank = self.ranks.pop(pid, None)
            if rank is None:
                continue
            self.last_active = real_time.monotonic()
            with contextlib.suppress(OSError):  # the client is gone
                os.write(rank.status_fd, _STATUS.pack(os.waitstatus_to_exitcode(status)))
            os.close(rank.status_fd)
            if rank.client in self.clients:
                self.clients[rank.client].discard(pid)

    def _drop(self, client: socket.socket) -> None:
        """A client left: its ranks still running are killed (nothing of a session outlives it)."""
        pids = self.clients.pop(client, set())
        self.sessions.discard(client)
        self.last_active = real_time.monotonic()
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(client)
        client.close()
        for pid in pids:
            if pid in self.ranks:
                _kill(pid)

    def _stop_accepting(self) -> None:
        if not self.accepting:
            return
        self.accepting = False
        if self.listener is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()
        with contextlib.suppress(OSError):  # only our own socket file, not a successor's
            if self.inode is not None and os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)


def _kill(pid: int) -> None:
    # A rank leads its own process group (what it started is in it) once set up.
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's own count is what can be known
        return 1


def _unsafe_threads(native_at_start: int) -> str:
    """Why forking now would be unsafe, or "" (no Python thread but this one, no native thread started since).

    Loading torch's C library starts one idle native thread (it waits on a futex and holds
    no lock a child could need), as in any fork server that imported torch; a thread
    started after the preload could hold one.
    """
    import threading

    if threading.active_count() != 1:
        return f"runs {threading.active_count()} Python threads"
    native = _native_threads()
    if native > native_at_start:
        return f"runs {native} threads, {native - native_at_start} more than after its preload"
    return ""


def serve(listener_fd: int, path: str, key: str, preload: list[str], idle: float) -> None:
    """Run a server on an already bound and listening socket (started by `accel.sim.runtime.forking`)."""
    listener = socket.socket(fileno=listener_fd)
    for name in preload:
        importlib.import_module(name)
    server = Server(listener, path, key, idle)
    try:
        server.serve()
    finally:
        server._stop_accepting()
        log = path[: -len(".sock")] + ".log"
        with contextlib.suppress(OSError):  # nothing to tell: no need to keep it
            if os.path.getsize(log) == 0:
                os.unlink(log)


def serve_session(conn: socket.socket, preload: list[str], fresh: dict[str, Any]) -> None:
    """In a child the session's own process forked once it had imported torch
    (`accel.sim.runtime.forking.fork_session_server`): serve that session alone, then exit.

    The child leaves behind what the session's process had set up for itself (its
    standard streams, signal handlers, logging handlers, warning filters, import hooks,
    torch's defaults), so that ranks forked from it start as they would from a fresh
    server; it dies with the session (parent-death signal), and exits once the
    session's connection closed and its ranks are gone. Never returns.
    """
    code = 1
    try:
        _leave_session_state(fresh)
        for name in preload:
            importlib.import_module(name)
        server = Server(None, "", "session", 0.0, record_files=False)
        server.accepting = False
        server.clients[conn] = set()
        server.selector.register(conn, selectors.EVENT_READ)
        server.serve()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _leave_session_state(fresh: dict[str, Any]) -> None:
    import faulthandler
    import logging
    import warnings

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the session ended before prctl took effect
            os._exit(1)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    # The session's streams may be pytest's capture files: a rank prints to its own fds.
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    # Other descriptors stay open: objects of modules imported before the fork may hold them
    # (closing them under their feet hung simulated NCCL groups). Whatever they are (pytest's
    # saved stdout included), they close when the session's server and ranks exit, which is
    # before the session does (`accel.sim.runtime.forking.end_session`), or with it.
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    # The filters the session applied over its own (pytest's), each once, from the front where
    # they were inserted; what imported modules added stays, as in a fresh server.
    filters = list(warnings.filters)
    for added in fresh.get("drop_filters", ()):
        if added in filters:
            filters.remove(added)
    warnings.filters[:] = filters  # type: ignore[index]  # a list at runtime
    warnings.showwarning = getattr(warnings, "_showwarning_orig", warnings.showwarning)
    if getattr(warnings._showwarnmsg_impl, "__module__", None) != "warnings":  # type: ignore[attr-defined]
        warnings._showwarnmsg_impl = _show_warning  # type: ignore[attr-defined]  # a recording session's list.append
    getattr(warnings, "_filters_mutated", lambda: None)()
    # pytest's assertion rewriting hook: ranks rewrite the test modules themselves (harness.remote).
    sys.meta_path[:] = [finder for finder in sys.meta_path if not type(finder).__module__.startswith("_pytest")]
    torch = sys.modules.get("torch")
    if torch is not None:  # each only when changed: setting the deterministic flag costs a second
        if torch.get_default_dtype() != torch.float32:
            torch.set_default_dtype(torch.float32)
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)
        torch.set_grad_enabled(True)


def _show_warning(message: Any) -> None:
    """What `warnings` shows a warning with in a fresh interpreter (its `_showwarnmsg_impl`)."""
    import warnings

    file = message.file if message.file is not None else sys.stderr
    if file is None:  # no stderr (pythonw): nowhere to show it
        return
    with contextlib.suppress(OSError):  # as warnings does: a broken stream loses the warning
        file.write(warnings._formatwarnmsg(message))  # type: ignore[attr-defined]


def stop_all(directory: str) -> int:
    """Ask every server whose socket is in `directory` to stop; how many were asked."""
    count = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.endswith(".sock"):
            continue
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5.0)
            try:
                sock.connect(os.path.join(directory, name))
                send(sock, ("stop",))
                count += 1
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m accel.sim.runtime.server", description="accel's rank server")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="(started by accel.sim.runtime.forking)")
    run.add_argument("--fd", type=int, required=True)
    run.add_argument("--path", required=True)
    run.add_argument("--key", required=True)
    run.add_argument("--preload", default="")
    run.add_argument("--idle", type=float, default=IDLE_TIMEOUT)
    commands.add_parser("stop", help="stop this user's rank servers (their ranks too)")
    args = parser.parse_args(argv)
    if args.command == "stop":
        print(f"asked {stop_all(server_directory())} rank server(s) to stop")
        return
    serve(args.fd, args.path, args.key, [name for name in args.preload.split(",") if name], args.idle)


if __name__ == "__main__":
    main()
