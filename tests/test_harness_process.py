"""Harness behaviours that need their own pytest process: xdist, coverage, Ctrl-C and kill -9."""

import signal
import subprocess
import sys
import time

import pytest
from harness_support import assert_nothing_left_running, is_rank_server
from support import process_gone

#: starts whole pytest sessions as a user would: `make test-frameworks` (CI's second step) runs these
pytestmark = pytest.mark.processes

pytest_plugins = ["pytester"]

NO_HYPOTHESIS = ("-p", "no:hypothesispytest")


@pytest.fixture(autouse=True)
def short_lived_rank_servers(monkeypatch):
    """The sessions started here have rank servers of their own (pytester's HOME is in their
    key): those need not wait long for a next session."""
    monkeypatch.setenv("ACCEL_SIM_SERVER_IDLE", "20")


#: a library whose every line is run by exactly one rank and none by pytest itself, so
#: that 100% coverage proves the lines run inside ranks were counted
MYLIB = """
def rank_zero_path():
    value = 0
    return value


def other_ranks_path(rank):
    value = rank * 2
    return value
"""

COVERED_TEST = """
from harness import distributed_test

@distributed_test(world_size=2)
def test_uses_mylib(rank):
    import mylib
    if rank == 0:
        assert mylib.rank_zero_path() == 0
    else:
        assert mylib.other_ranks_path(rank) == 2
"""


def test_xdist_workers_and_pytest_cov_count_lines_run_in_ranks(pytester):
    pytester.makepyfile(mylib=MYLIB, test_h_cov=COVERED_TEST)
    pytester.makepyfile(
        test_h_xdist="""
        import pytest
        from harness import distributed_test

        @distributed_test(world_size=[2, 3])
        @pytest.mark.parametrize("n", range(3))
        def test_sum(rank, world_size, n):
            import torch, torch.distributed as dist  # here: the pytest workers need no torch
            value = torch.tensor([float(n)])
            dist.all_reduce(value)
            assert value.item() == n * world_size

        @distributed_test(world_size=2)
        def test_fails(rank):
            assert rank == 0
        """
    )
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-n", "2", "--cov=mylib", "--cov-report=term-missing")
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_fails*rank 1: AssertionError*"])
    result.stdout.fnmatch_lines(["mylib.py * 6 * 0 * 100%*"])


def test_coverage_run_counts_lines_run_in_ranks(pytester):
    pytester.makepyfile(mylib=MYLIB, test_h_cov=COVERED_TEST)
    run = pytester.run(
        sys.executable,
        "-m",
        "coverage",
        "run",
        "--parallel-mode",
        "--source=mylib",
        "-m",
        "pytest",
        *NO_HYPOTHESIS,
        "-q",
    )
    assert run.ret == 0, run.stdout.str()
    assert pytester.run(sys.executable, "-m", "coverage", "combine").ret == 0
    report = pytester.run(sys.executable, "-m", "coverage", "report", "-m")
    report.stdout.fnmatch_lines(["mylib.py * 6 * 0 * 100%*"])


HANGING_TEST = """
import os, pathlib, time
from harness import distributed_test

@distributed_test(world_size=2, timeout=120)
def test_waits(rank):
    marker = pathlib.Path(__file__).parent / f"rank{rank}.pids"
    marker.write_text(f"{os.getpid()} {os.getppid()}")
    while True:
        time.sleep(0.05)
"""


def _as_from_a_terminal():
    # A session started from a shell takes Ctrl-C; one started here inherits this worker's disposition and
    # signal mask, which an earlier test of the worker may have left ignoring or blocking SIGINT (Python then
    # installs no KeyboardInterrupt handler, and the session would never stop on Ctrl-C).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _worker_sigint():
    """How this worker takes SIGINT now (shown when a session does not stop)."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    return f"this worker's SIGINT handler {signal.getsignal(signal.SIGINT)!r}, blocked: {blocked}"


def _start_hanging_session(pytester):
    pytester.makepyfile(test_h_waits=HANGING_TEST)
    # the session's output goes to a file: a pipe nobody reads fills up with what an interrupted session
    # prints (its report, the ranks' stacks) and holds the session in its write, as if it never stopped
    log = (pytester.path / "session.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *NO_HYPOTHESIS, "-q", "-p", "no:cacheprovider", "test_h_waits.py"],
        cwd=pytester.path,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_as_from_a_terminal,
    )
    log.close()
    markers = [pytester.path / f"rank{rank}.pids" for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(marker.exists() and marker.read_text() for marker in markers):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the ranks never started:\n{(pytester.path / 'session.log').read_text()}")
        time.sleep(0.05)
    pids = [marker.read_text().split() for marker in markers]
    return process, {int(rank) for rank, _ in pids}, {int(parent) for _, parent in pids}


@pytest.mark.parametrize("server", ["1", "0"], ids=["rank-server", "own-fork-server"])
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_nothing_is_left_running_when_the_session_is_interrupted_or_killed(pytester, monkeypatch, how, server):
    # With the rank server (the default) the session's ranks die with the session and the
    # server stays, without them; a session's own fork server goes with it.
    monkeypatch.setenv("ACCEL_SIM_SERVER", server)
    process, ranks, parents = _start_hanging_session(pytester)
    assert all(not process_gone(pid, within=0) for pid in ranks | parents)
    assert all(is_rank_server(pid) == (server == "1") for pid in parents)
    process.send_signal(how)
    try:
        # a few seconds on a quiet machine; CI's second step runs this beside whole framework launches, under
        # which 30 s was seen to pass by (a session that never stops still fails here)
        process.wait(90)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the session did not stop within 90 s ({_worker_sigint()}); its output:\n"
            f"{(pytester.path / 'session.log').read_text()[-4000:]}"
        )
    finally:
        if process.poll() is None:
            process.kill()
    if how == signal.SIGINT:
        assert process.returncode == 2  # pytest's "interrupted"
    assert_nothing_left_running(ranks, parents)
