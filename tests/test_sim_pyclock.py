"""Python's clocks on the simulated GPU host's time (``ACCEL_SIM_CLOCK=gpu``, `accel launch --clock gpu`),
in this process: what they read, that they never run backwards, what keeps real time, and the options refused.

The mode is installed here by hand on a clock of our own (`clock.start`), and always put back.
"""

import asyncio
import multiprocessing.connection
import os
import re
import time
from types import SimpleNamespace

import pytest

from accel.commands import cli, launch
from accel.sim import real_time
from accel.sim.cuda.timing import clock as clocks
from accel.sim.cuda.timing import pyclock


@pytest.fixture
def gpu_clock(monkeypatch):
    """A running clock, and `time`'s clocks following it."""
    monkeypatch.setenv(clocks.CLOCK_ENV, "gpu")
    running = clocks.start()
    pyclock.configure()
    try:
        yield running
    finally:
        pyclock.restore()
        clocks.stop()


def test_the_modes_and_their_spellings():
    assert [pyclock.mode(v) for v in ("", "host", "ON", "1", " gpu ", "GPU", "off", "0", "no")] == [
        "host",
        "host",
        "host",
        "host",
        "gpu",
        "gpu",
        "off",
        "off",
        "off",
    ]
    with pytest.raises(ValueError, match="ACCEL_SIM_CLOCK='gpus': use gpu"):
        pyclock.mode("gpus")


def test_each_clock_reads_its_real_start_plus_the_simulated_host(gpu_clock):
    assert pyclock.installed() and time.perf_counter is not real_time.perf_counter
    before = {name: getattr(time, name)() for name in pyclock.NAMES}
    real_before = real_time.time()
    gpu_clock.host += 2.5  # what the host's launches and waits add up to
    for name in ("perf_counter", "monotonic", "time"):
        assert getattr(time, name)() - before[name] == pytest.approx(2.5, abs=1e-6)
    for name in ("perf_counter_ns", "monotonic_ns", "time_ns"):
        assert getattr(time, name)() - before[name] == pytest.approx(2.5e9, abs=1e3)
    assert abs(before["time"] - real_before) < 5  # the epoch's seconds, not the simulation's
    time.sleep(0.05)  # real time passing is not the host's
    assert time.perf_counter() - before["perf_counter"] == pytest.approx(2.5, abs=1e-6)


def test_a_clock_called_from_c_with_no_python_caller_reads_simulated_time(gpu_clock, monkeypatch):
    # C code calls it with no Python frame above (autograd's engine threads in torchtitan's backward): an
    # exception there aborts the process ("terminate called without an active exception")
    import _thread
    import sys
    import threading

    raised, done = [], threading.Event()
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: raised.append(unraisable.exc_value))
    gpu_clock.host += 2.5
    expected = time.perf_counter()
    _thread.start_new_thread(lambda: (time.perf_counter, done.set()), ())  # a thread is up: the C start works
    done.wait(5)
    _thread.start_new_thread(time.perf_counter, ())  # the replacement itself is the thread's first frame
    deadline = real_time.monotonic() + 1
    while not raised and real_time.monotonic() < deadline:
        real_time.perf_counter()
    assert raised == []
    assert time.perf_counter() == pytest.approx(expected)


def test_simulated_time_never_runs_backwards(gpu_clock, monkeypatch):
    gpu_clock.host += 1.0
    first = time.monotonic()
    again = clocks.start()  # CUDA starting again: a new clock, at zero
    pyclock.configure()
    assert time.monotonic() == pytest.approx(first, abs=1e-9)
    again.host += 0.25
    assert time.monotonic() == pytest.approx(first + 0.25, abs=1e-6)
    clocks.stop()  # no clock: time stands where it was
    assert time.monotonic() == pytest.approx(first + 0.25, abs=1e-6)
    reads = [time.perf_counter_ns() for _ in range(100)]
    assert reads == sorted(reads)


def test_the_standard_librarys_waits_and_the_simulators_keep_real_time(gpu_clock):
    read, write = os.pipe()
    try:
        start = real_time.monotonic()
        # multiprocessing's wait loops on time.monotonic: on a clock standing still it would never time out
        assert multiprocessing.connection.wait([read], timeout=0.2) == []
        asyncio.run(asyncio.sleep(0.1))  # so does asyncio's event loop
        assert 0.25 <= real_time.monotonic() - start < 5
    finally:
        os.close(read)
        os.close(write)
    assert getattr(time.monotonic, real_time.REAL_ATTRIBUTE) is real_time.monotonic


def test_the_collective_checks_shared_memory_wait_times_out_in_real_seconds(gpu_clock, tmp_path):
    from accel.sim.diagnoses import collectives

    if collectives._SYS_FUTEX is None:
        pytest.skip("the check's shared-memory exchange needs Linux's futex")
    exchange = collectives._Exchange(str(tmp_path / "check.shm"), 0, 2)
    start = real_time.monotonic()
    # rank 1 never publishes: on the simulated clock, standing still, rank 0 would wait for ever
    assert exchange.collect([1], 0, "group", 1, timeout=0.3) is None
    assert 0.3 <= real_time.monotonic() - start < 5


def test_restore_puts_the_real_clocks_back_and_leaves_another_patch_alone(monkeypatch):
    monkeypatch.setenv(clocks.CLOCK_ENV, "gpu")
    clocks.start()
    try:
        pyclock.configure()
        pyclock.restore()
        assert time.perf_counter is real_time.perf_counter and not pyclock.installed()
        monkeypatch.setenv(clocks.CLOCK_ENV, "host")
        pyclock.configure()  # the mode is read each time CUDA starts
        assert time.time is real_time.time
        frozen = lambda: 0.0  # noqa: E731  # a test's own patch of time
        monkeypatch.setattr(time, "monotonic", frozen)
        pyclock.restore()
        assert time.monotonic is frozen
    finally:
        pyclock.restore()
        clocks.stop()


def test_the_clock_off_installs_nothing(monkeypatch):
    monkeypatch.setenv(clocks.CLOCK_ENV, "off")
    assert clocks.start() is None
    pyclock.configure()
    assert not pyclock.installed() and time.perf_counter is real_time.perf_counter


def _parse(*argv):
    return cli.build_parser().parse_args(["launch", *argv, __file__])


@pytest.mark.parametrize(
    ("argv", "environ", "error"),
    [
        (["--simulate", "cpu", "--clock", "gpu"], None, "--clock is about simulated GPUs: use it with --simulate cuda"),
        (["--clock", "gpu"], None, "--clock applies to simulated runs only"),
        (
            ["--simulate", "cuda", "--clock", "gpu"],
            "off",
            "--clock gpu runs the simulated clock, which ACCEL_SIM_CLOCK=off stops",
        ),
        (
            ["--simulate", "cuda", "--clock", "off", "--timing_report", "t.json"],
            None,
            "--timing_report reports on the simulated clock, which --clock off stops",
        ),
        (
            ["--simulate", "cuda", "--clock", "off", "--tokens_per_step", "8"],
            None,
            "--tokens_per_step reports on the simulated clock",
        ),
    ],
)
def test_clock_options_are_refused_where_they_do_not_apply(monkeypatch, argv, environ, error):
    monkeypatch.delenv(clocks.CLOCK_ENV, raising=False)
    if environ is not None:
        monkeypatch.setenv(clocks.CLOCK_ENV, environ)
    with pytest.raises(ValueError, match=re.escape(error)):
        launch.check_args(_parse(*argv))


def test_clock_options_that_apply_are_passed_to_the_ranks(monkeypatch):
    from accel.commands import simulate

    monkeypatch.delenv(clocks.CLOCK_ENV, raising=False)
    for value in ("gpu", "host", "off"):
        args = _parse("--simulate", "cuda", "--clock", value)
        launch.check_args(args)
        assert simulate._timing_env(args)[clocks.CLOCK_ENV] == value
    assert clocks.CLOCK_ENV not in simulate._timing_env(SimpleNamespace())
    with pytest.raises(SystemExit):
        _parse("--simulate", "cuda", "--clock", "wall")  # argparse: not a choice
