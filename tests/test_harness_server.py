"""The rank server (`accel.sim.runtime.server`): shared by sessions and by `-n N` workers, keyed, never
serving a changed project, stopped when idle, leaving nothing of a session running; and the
harness starting the first distributed test's ranks while pytest still collects."""

import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
from harness_support import assert_nothing_left_running, children, is_rank_server
from support import RECORDING, process_gone

from accel.sim.runtime import forking, server
from harness.plugin import first_distributed_config

#: starts whole pytest sessions as a user would: `make test-frameworks` (CI's second step) runs these
pytestmark = pytest.mark.processes

pytest_plugins = ["pytester"]

NO_HYPOTHESIS = ("-p", "no:hypothesispytest")


@pytest.fixture
def own_servers(monkeypatch):
    """Rank servers of this test only (its own key), stopped at its end."""
    monkeypatch.setenv("ACCEL_SIM_SERVER", "1")  # on under CI too
    monkeypatch.setenv("ACCEL_SIM_SERVER_IDLE", "30")
    started = set()
    yield started
    for pid in started:
        if not process_gone(pid, within=0):
            os.kill(pid, signal.SIGTERM)
        assert process_gone(pid)


def _pids(pytester):
    folder = pytester.path / "pids"
    found = {int(path.name): int(path.read_text()) for path in folder.iterdir()}
    for path in folder.iterdir():
        path.unlink()
    return found


def test_sessions_and_their_workers_share_one_server_and_leave_no_rank_running(pytester, own_servers):
    pytester.makepyfile(test_h_a=RECORDING.format(name="a"), test_h_b=RECORDING.format(name="b"))
    first = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-n", "2")
    first.assert_outcomes(passed=2)
    ranks = _pids(pytester)
    servers = set(ranks.values())
    own_servers.update(servers)
    assert len(servers) == 1 and is_rank_server(next(iter(servers)))  # both workers' ranks came from it
    assert_nothing_left_running(set(ranks), servers)

    second = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-n", "2")
    second.assert_outcomes(passed=2)
    again = _pids(pytester)
    assert set(again.values()) == servers  # the next session found it warm
    assert not set(again) & set(ranks)  # with ranks of its own
    assert_nothing_left_running(set(again), servers)


def test_each_session_its_own_fork_server_when_asked(pytester, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_SERVER", "0")
    pytester.makepyfile(test_h_a=RECORDING.format(name="a"))
    pytester.runpytest_subprocess(*NO_HYPOTHESIS).assert_outcomes(passed=1)
    ranks = _pids(pytester)
    assert not any(is_rank_server(parent) for parent in ranks.values())
    assert_nothing_left_running(set(ranks), set(ranks.values()))


@pytest.fixture
def preloaded_module(tmp_path, monkeypatch):
    """A module of the 'project' that rank servers of this test preload (and so a key of their own)."""
    module = tmp_path / "h_server_preloaded.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(forking, "_extra_preload", [*forking._extra_preload, "h_server_preloaded"])
    return module


def test_a_server_never_serves_a_changed_project(preloaded_module, own_servers):
    before = forking._connect()
    own_servers.add(before.server_pid)
    again = forking._connect()
    assert again.server_pid == before.server_pid
    again.close()

    preloaded_module.write_text("VALUE = 2  # edited\n")
    after = forking._connect()
    own_servers.add(after.server_pid)
    assert after.server_pid != before.server_pid  # it refused; a fresh server imported the new file
    assert not process_gone(before.server_pid, within=0)  # still serving its client...
    before.close()
    assert process_gone(before.server_pid)  # ...then gone with it
    after.close()


def test_an_idle_server_stops(preloaded_module, monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_SERVER_IDLE", "1")
    client = forking._connect()
    assert not process_gone(client.server_pid, within=0)
    client.close()
    assert process_gone(client.server_pid, within=30)


def test_a_client_gone_takes_its_ranks_with_it(preloaded_module, own_servers, tmp_path, monkeypatch):
    from accel.sim.runtime.pool import RankPool

    # A pool the harness is starting in the background (for a module's first distributed test)
    # would have its next rank forked by this test's server while forking's globals point there.
    for thread in threading.enumerate():
        if thread.name.startswith("accel-sim-prestart"):
            thread.join(120)
            assert not thread.is_alive(), f"{thread.name} still starting ranks"
    monkeypatch.setattr(forking, "_session", None)  # not from this session's own server, if it has one

    client = forking._connect()
    own_servers.add(client.server_pid)
    previous = forking._client, forking._client_pid
    forking._client, forking._client_pid = client, os.getpid()
    used = forking.use_server(True)
    try:
        pool = RankPool(2, "cpu")
        pool.start()
    finally:
        forking._client, forking._client_pid = previous
        forking.use_server(used)
    ranks = set(pool.pids)
    assert set(children(client.server_pid)) == ranks
    client.close()  # as when the session is killed: the server kills them
    assert all(process_gone(pid) for pid in ranks)
    assert [proc.join(10) or proc.exitcode for proc in pool._procs] == [-signal.SIGKILL] * 2
    pool.kill()


def test_the_server_refuses_to_fork_with_threads_running():
    # In a fresh interpreter, as the server is: this pytest process may run threads of its own
    # (the harness starting a module's ranks in the background).
    code = (
        "import threading\n"
        "from accel.sim.runtime import server\n"
        "native = server._native_threads()\n"
        "print(repr(server._unsafe_threads(native)))\n"
        "stop = threading.Event()\n"
        "thread = threading.Thread(target=stop.wait)\n"
        "thread.start()\n"
        "print(repr(server._unsafe_threads(native)))\n"
        "stop.set()\n"
        "thread.join()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    alone, with_a_thread = out.stdout.splitlines()
    assert alone == "''"
    assert "runs 2 Python threads" in with_a_thread


@pytest.mark.parametrize(
    ("server", "ci", "wanted"),
    [(None, None, True), (None, "true", False), ("1", "true", True), ("0", None, False), (None, "0", True)],
)
def test_the_server_is_on_by_default_except_under_ci(monkeypatch, server, ci, wanted):
    for name, value in ((forking.SERVER_ENV, server), ("CI", ci)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert forking.server_wanted() is wanted


def test_the_key_follows_what_the_preloaded_modules_depend_on(monkeypatch):
    key = forking.server_key()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")  # one worker's moment: same server
    monkeypatch.setenv("COV_CORE_SOURCE", "somewhere")
    assert forking.server_key() == key
    monkeypatch.setenv("H_SOME_SETTING", "1")
    assert forking.server_key() != key
    monkeypatch.delenv("H_SOME_SETTING")
    monkeypatch.setattr(sys, "path", [*sys.path, "/elsewhere"])
    assert forking.server_key() != key


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("@distributed_test(world_size=2)\ndef test_a(rank): ...\n", (2, "cpu")),
        ("@harness.distributed_test(3, 'xla')\ndef test_a(rank): ...\n", (3, "xla")),
        ("@distributed_test(world_size=[2, 4], device=['cuda', 'cpu'])\ndef test_a(rank): ...\n", (2, "cuda")),
        ("@distributed_test()\ndef test_a(rank): ...\n", (4, "cpu")),
        ("@distributed_test(isolated=True)\ndef test_a(rank): ...\n", None),
        ("@distributed_test(world_size=SIZES)\ndef test_a(rank): ...\n", None),
        ("def test_plain(): ...\n", None),
        ("class TestIt:\n    @distributed_test(world_size=1)\n    def test_m(self, rank): ...\n", (1, "cpu")),
    ],
)
def test_the_first_distributed_configuration_is_read_from_the_source(tmp_path, source, expected):
    path = tmp_path / "test_h_source.py"
    path.write_text(source)
    assert first_distributed_config(str(path)) == expected


def test_the_first_pool_starts_while_pytest_collects_and_serves_the_first_test(pytester):
    pytester.makepyfile(test_h_a=RECORDING.format(name="a"))
    pytester.makeconftest(
        """
        import pathlib
        from harness.plugin import MANAGER_KEY

        def pytest_sessionfinish(session):
            started = session.config.stash[MANAGER_KEY].pools_started
            (pathlib.Path(__file__).parent / "started").write_text(str(started))
        """
    )
    pytester.runpytest(*NO_HYPOTHESIS).assert_outcomes(passed=1)
    assert (pytester.path / "started").read_text() == "1"  # started ahead, then used


def test_no_pool_starts_for_a_module_the_command_line_leaves_out(pytester):
    # pytest makes a module node for each file of the folder (test_h_a.py too) before it keeps
    # the one named; test_h_a.py's distributed test never runs, and no ranks start for it.
    pytester.makepyfile(test_h_a=RECORDING.format(name="a"), test_h_b="def test_plain():\n    pass\n")
    pytester.makeconftest(
        """
        import pathlib, threading
        from harness.plugin import MANAGER_KEY

        def pytest_sessionfinish(session):
            started = session.config.stash[MANAGER_KEY].pools_started
            starting = [t.name for t in threading.enumerate() if t.name.startswith("accel-sim-prestart")]
            (pathlib.Path(__file__).parent / "started").write_text(f"{started} {starting}")
        """
    )
    pytester.runpytest(*NO_HYPOTHESIS, "test_h_b.py").assert_outcomes(passed=1)
    assert (pytester.path / "started").read_text() == "0 []"


# -- the first session: ranks forked from the session itself -----------------------------------

TORCH_AT_TOP = """
import json, logging, os, pathlib, sys, warnings

import torch
import torch.distributed as dist

from harness import distributed_test


@distributed_test(world_size=2)
def test_{name}(rank):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
    parent = os.getppid()
    with open(f"/proc/{{parent}}/stat") as handle:
        grandparent = int(handle.read().rpartition(")")[2].split()[1])
    def cmdline(pid):
        with open(f"/proc/{{pid}}/cmdline", "rb") as handle:
            return handle.read().decode()

    state = {{
        "parent": parent,
        "parent_cmdline": cmdline(parent),
        "grandparent_cmdline": cmdline(grandparent),
        "real_stdout": sys.stdout is sys.__stdout__ and sys.stdout.fileno() == 1,
        "root_handlers": [type(handler).__module__ for handler in logging.getLogger().handlers],
        "root_level": logging.getLogger().level,
        "finders": [type(finder).__module__ for finder in sys.meta_path],
        "showwarning": warnings.showwarning.__module__,
        "showwarnmsg": getattr(warnings._showwarnmsg_impl, "__module__", None),
        "always_deprecation": any(
            action == "always" and category is DeprecationWarning for action, _, category, *_ in warnings.filters
        ),
        "traced": sys.gettrace() is not None,
        "threads": len(os.listdir("/proc/self/task")),
        "descriptors": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    }}
    folder = pathlib.Path(__file__).parent / "ranks"
    folder.mkdir(exist_ok=True)
    (folder / str(os.getpid())).write_text(json.dumps(state))
    print(f"hello from rank {{rank}}")
    logging.warning("a warning logged by rank %d", rank)
"""


def _rank_states(pytester):
    folder = pytester.path / "ranks"
    found = {int(path.name): json.loads(path.read_text()) for path in folder.iterdir()}
    for path in folder.iterdir():
        path.unlink()
    return found


@pytest.fixture
def server_folder(monkeypatch):
    """Rank servers of this test's sessions in a folder of their own (TMPDIR), stopped at its end."""
    temp = pathlib.Path(tempfile.mkdtemp(prefix="h-", dir="/tmp"))  # short: socket paths have a limit
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("ACCEL_SIM_SERVER_IDLE", "30")
    folder = temp / f"accel-sim-{os.getuid()}"
    yield folder
    server.stop_all(str(folder))
    shutil.rmtree(temp, ignore_errors=True)


def _sockets(folder):
    return sorted(path.name for path in folder.glob("*.sock")) if folder.is_dir() else []


def _assert_forked_from_the_session(states):
    for state in states.values():
        assert not is_rank_server(state["parent"])
        assert state["parent_cmdline"] == state["grandparent_cmdline"]  # a fork of the session
        assert "pytest" in state["grandparent_cmdline"]
        # ...that left the session's own set-up behind
        assert state["real_stdout"] and not state["traced"]
        assert state["root_handlers"] == [] and state["root_level"] == logging.WARNING
        assert not any(module.startswith("_pytest") for module in state["finders"])
        assert state["showwarning"] == "warnings" and not state["always_deprecation"]
        assert state["showwarnmsg"] in ("warnings", "accel.sim.runtime.server")


def test_the_first_session_forks_its_ranks_from_itself_and_leaves_the_server_for_the_next(
    pytester, monkeypatch, server_folder
):
    monkeypatch.setenv("ACCEL_SIM_SERVER", "1")
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_h_first=TORCH_AT_TOP.format(name="first"))
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*hello from rank 0*"])  # what ranks print still reaches the session
    result.stderr.fnmatch_lines(["*a warning logged by rank 1*"])
    states = _rank_states(pytester)
    assert len(states) == 2
    _assert_forked_from_the_session(states)
    parents = {state["parent"] for state in states.values()}
    assert_nothing_left_running(set(states), parents)  # the session's own server ended with it
    assert len(_sockets(server_folder)) == 1  # ...and it started the shared one as it ended

    pytester.runpytest_subprocess(*NO_HYPOTHESIS).assert_outcomes(passed=1)
    again = _rank_states(pytester)
    servers = {state["parent"] for state in again.values()}
    assert len(servers) == 1 and is_rank_server(next(iter(servers)))  # the next session found it
    assert_nothing_left_running(set(again), servers)


def test_under_ci_each_session_forks_its_ranks_from_itself_and_starts_no_server(pytester, monkeypatch, server_folder):
    monkeypatch.delenv("ACCEL_SIM_SERVER", raising=False)
    monkeypatch.setenv("CI", "true")
    pytester.makepyfile(test_h_ci=TORCH_AT_TOP.format(name="ci"))
    for _ in range(2):
        pytester.runpytest_subprocess(*NO_HYPOTHESIS).assert_outcomes(passed=1)
        states = _rank_states(pytester)
        _assert_forked_from_the_session(states)
        assert_nothing_left_running(set(states), {state["parent"] for state in states.values()})
    assert _sockets(server_folder) == []


def test_a_session_running_threads_does_not_fork_itself(pytester, monkeypatch, server_folder):
    monkeypatch.setenv("ACCEL_SIM_SERVER", "0")
    pytester.makepyfile(test_h_threads=TORCH_AT_TOP.format(name="threads"))
    pytester.makeconftest(
        """
        import pathlib, threading
        from accel.sim.runtime import forking

        _stop = threading.Event()
        threading.Thread(target=_stop.wait, daemon=True).start()

        def pytest_sessionfinish(session):
            (pathlib.Path(__file__).parent / "refusal").write_text(forking.session_refusal)
            _stop.set()
        """
    )
    pytester.runpytest_subprocess(*NO_HYPOTHESIS).assert_outcomes(passed=1)
    assert "Python threads" in (pytester.path / "refusal").read_text()
    states = _rank_states(pytester)
    assert all(state["parent_cmdline"] != state["grandparent_cmdline"] for state in states.values())
    assert_nothing_left_running(set(states), {state["parent"] for state in states.values()})


def test_the_threads_torch_import_started_are_known_and_its_loader_is_its_own():
    code = (
        "import sys, threading\n"
        "from accel.sim.runtime import forking\n"
        "forking.watch_torch_import()\n"
        "import torch\n"
        "assert forking._torch_threads == forking._native_threads() >= 1, forking._torch_threads\n"
        "assert type(torch.__loader__).__name__ == type(torch.__spec__.loader).__name__ == 'SourceFileLoader'\n"
        "assert not any(isinstance(f, forking._TorchImportWatch) for f in sys.meta_path)\n"
        "assert forking.self_fork_refusal() == '', forking.self_fork_refusal()\n"
        "sys.settrace(lambda *args: None)  # as coverage does: ranks must start their own\n"
        "assert 'traced' in forking.self_fork_refusal()\n"
        "sys.settrace(None)\n"
        "torch.set_num_threads(2)\n"
        "torch.ones(4096, 4096).sum(); torch.ones(256, 256) @ torch.ones(256, 256)\n"
        "threading.Thread(target=lambda: None).start()\n"
        "print(forking.self_fork_refusal())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "threads" in done.stdout


def test_intermediate_processes_left_detached_are_reaped_at_exit(monkeypatch):
    import subprocess
    import sys
    import time

    done = subprocess.Popen([sys.executable, "-c", "pass"])  # ends at once, not reaped yet
    lasting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(forking, "_detached", [done, lasting])
    time.sleep(0.5)
    started = time.monotonic()
    forking.reap_detached(timeout=1.0)
    try:
        assert done.returncode == 0  # reaped: no "still running" warning when collected
        assert forking._detached == [lasting] and time.monotonic() - started < 5  # one still running is waited for
    finally:
        lasting.kill()
        lasting.wait()
