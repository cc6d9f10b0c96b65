"""Rank servers are bounded per project (`accel.sim.runtime.server`): a server that becomes idle
stops the project's other idle servers, never one in use, nor another project's."""

import hashlib
import math
import os
import pathlib
import shutil
import signal
import socket
import tempfile

import pytest
from harness_support import assert_nothing_left_running, is_rank_server
from support import RECORDING, process_gone

from accel.sim.runtime import forking, server

#: starts whole processes as a user would: `make test-frameworks` (CI's second step) runs these
pytestmark = pytest.mark.processes

pytest_plugins = ["pytester"]

NO_HYPOTHESIS = ("-p", "no:hypothesispytest")


@pytest.fixture
def servers(monkeypatch, tmp_path_factory):
    """A server folder of this test's own (TMPDIR); the pids of the servers it started, which are
    all gone at its end (asked to stop, then killed if they did not)."""
    tmp_path_factory.getbasetemp()  # pytest's, in the real temporary folder, before it changes
    temp = pathlib.Path(tempfile.mkdtemp(prefix="hb-", dir="/tmp"))  # short: socket paths have a limit
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # gettempdir() caches its answer
    monkeypatch.setenv("ACCEL_SIM_SERVER", "1")  # on under CI too
    monkeypatch.setenv("ACCEL_SIM_SERVER_IDLE", "120")  # ends them even if this fixture could not
    folder = temp / f"accel-sim-{os.getuid()}"
    started: dict[int, forking.ServerClient | None] = {}
    yield folder, started
    for client in started.values():  # a failed test's clients: their servers wait for them
        if client is not None:
            client.close()
    server.stop_all(str(folder))
    leftovers = [pid for pid in started if not process_gone(pid)]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)
    assert not leftovers, f"servers {leftovers} did not stop when asked"


def _project(path: pathlib.Path) -> pathlib.Path:
    """A git work tree (as far as `project_folder` looks: a `.git` at its top) with a subfolder."""
    (path / ".git").mkdir(parents=True)
    (path / "sub").mkdir()
    return path


def _connect(started: dict[int, forking.ServerClient | None]) -> forking.ServerClient:
    client = forking._connect()
    started[client.server_pid] = client
    return client


def _socket_of(folder: pathlib.Path, pid: int) -> pathlib.Path:
    """The socket the server `pid` listens at (its command line names it)."""
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        args = handle.read().decode().split("\0")
    path = pathlib.Path(args[args.index("--path") + 1])
    assert path.parent == folder
    return path


def _handled(path: pathlib.Path, asker_idle_since: float = -math.inf) -> None:
    """Ask the server at `path` to stop if idle, as a server idle since `asker_idle_since` would
    (by default since forever, which stops none): once it closed the connection, it handled
    this request and every one that reached it before."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        server.send(sock, ("stop-if-idle", asker_idle_since, 0))
        assert sock.recv(1) == b""


def _alive(path: pathlib.Path, pid: int) -> bool:
    return path.exists() and not process_gone(pid, within=0)


def test_a_project_keeps_one_idle_server_and_never_stops_one_in_use(servers, monkeypatch, tmp_path):
    folder, started = servers
    project, other = _project(tmp_path / "project"), _project(tmp_path / "other")
    monkeypatch.chdir(other)  # another project's idle server: not this project's to stop
    elsewhere = _connect(started)
    elsewhere.close()

    monkeypatch.chdir(project)
    monkeypatch.setenv("H_BOUND_ENV", "a")
    a = _connect(started)
    monkeypatch.chdir(project / "sub")  # the same project, from a subfolder, in another environment
    monkeypatch.setenv("H_BOUND_ENV", "b")
    b = _connect(started)
    assert len({elsewhere.server_pid, a.server_pid, b.server_pid}) == 3  # today's keys: three servers
    a_path, b_path = _socket_of(folder, a.server_pid), _socket_of(folder, b.server_pid)
    assert server.sibling_sockets(str(a_path)) == [str(b_path)]

    # b asked a to stop as it started (before it answered our hello), and now an asker idle since
    # later than anyone: a, in use, refused both.
    _handled(a_path, math.inf)
    assert _alive(a_path, a.server_pid)
    a.close()
    _handled(a_path)  # a is idle from here on, and asked b to stop; b, in use, refused
    _handled(b_path)
    assert _alive(a_path, a.server_pid) and _alive(b_path, b.server_pid)

    b.close()  # b becomes idle after a did: a stops, b stays for the project's next session
    assert process_gone(a.server_pid)
    _handled(b_path)
    assert not a_path.exists()
    assert _alive(b_path, b.server_pid)
    assert _alive(_socket_of(folder, elsewhere.server_pid), elsewhere.server_pid)
    assert len(list(folder.glob("*.sock"))) == 2  # one idle per project


def test_of_two_idle_servers_the_one_idle_since_earlier_stops():
    idle = server.Server(None, "", "key", 60.0, record_files=False)
    idle.accepting = True  # as a server with a listener (none here: nothing to close)
    asker, theirs = socket.socketpair()
    with theirs:
        idle.clients[asker] = set()
        assert idle.idle_since is not None
        idle._stop_if_idle(asker, idle.idle_since - 1, os.getpid() + 1)  # idle since earlier: stays
        assert idle.accepting and asker not in idle.clients

        session, peer = socket.socketpair()
        with peer:
            idle.clients[session] = set()  # connected, no hello yet: about to use it
            asker, theirs_too = socket.socketpair()
            idle.clients[asker] = set()
            idle._stop_if_idle(asker, idle.idle_since + 1, 0)
            assert idle.accepting
            theirs_too.close()
            idle._drop(session)

        asker, last = socket.socketpair()
        idle.clients[asker] = set()
        idle._stop_if_idle(asker, idle.idle_since + 1, 0)  # idle since later than this one: it stops
        assert not idle.accepting
        last.close()
    idle.selector.close()
    for fd in (idle.wake_r, idle.wake_w):
        os.close(fd)


def test_project_folder_is_the_git_work_tree_else_the_working_directory(monkeypatch, tmp_path):
    project = _project(tmp_path / "project")
    monkeypatch.chdir(project / "sub")
    assert forking.project_folder() == str(project.resolve())
    plain = tmp_path / "plain" / "deeper"
    plain.mkdir(parents=True)
    monkeypatch.chdir(plain)
    if not any((parent / ".git").exists() for parent in plain.resolve().parents):
        assert forking.project_folder() == str(plain.resolve())
    assert os.path.basename(forking.socket_path("0" * 64)).startswith(
        hashlib.sha256(forking.project_folder().encode()).hexdigest()[:16] + "-"
    )


def _session_servers(pytester) -> set[int]:
    folder = pytester.path / "pids"
    parents = {int(path.read_text()) for path in folder.iterdir()}
    ranks = {int(path.name) for path in folder.iterdir()}
    shutil.rmtree(folder)
    assert all(is_rank_server(parent) for parent in parents)
    assert_nothing_left_running(ranks, parents)
    return parents


def test_sessions_in_two_environments_leave_one_idle_server(pytester, servers, monkeypatch):
    folder, started = servers
    pytester.makepyfile(test_hb_a=RECORDING.format(name="a"), test_hb_b=RECORDING.format(name="b"))
    monkeypatch.setenv("H_BOUND_ENV", "a")
    pytester.runpytest_subprocess(*NO_HYPOTHESIS).assert_outcomes(passed=2)
    first = _session_servers(pytester)
    started.update(dict.fromkeys(first))
    monkeypatch.setenv("H_BOUND_ENV", "b")
    pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-n", "2").assert_outcomes(passed=2)
    second = _session_servers(pytester)
    started.update(dict.fromkeys(second))
    assert len(first) == len(second) == 1 and first != second  # both workers used one server
    (old,), (new,) = first, second
    assert process_gone(old)  # the new one stopped it when it started
    assert [path.name for path in folder.glob("*.sock")] == [_socket_of(folder, new).name]
