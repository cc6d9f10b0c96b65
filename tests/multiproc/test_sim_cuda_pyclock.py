"""Ranks on simulated GPUs whose Python clocks read the simulated host (``ACCEL_SIM_CLOCK=gpu``), the
simulator's own timeouts in real seconds all the same, and the timing report of `accel.sim.launch` and
`@distributed_test` (`timing_report=`).

Each figure is compared with the clock's own (`accel.sim.cuda.timing`), not with a constant.
"""

import json
import os
import time

import pytest
import torch

import accel.sim
from accel.sim import real_time
from harness import distributed_test

aten = torch.ops.aten


def _follow_the_gpu_clock():
    """This task's Python clocks on the simulated host, as ``--clock gpu`` has them from the script's start."""
    from accel.sim.cuda import fake
    from accel.sim.cuda.timing import clock, pyclock

    os.environ["ACCEL_SIM_CLOCK"] = "gpu"
    fake.reconfigure()  # CUDA may have started in this task already: it starts again, reading the mode
    torch.zeros(1, device="cuda")  # else it starts here
    assert pyclock.installed()
    return clock.current()


@distributed_test(world_size=2, device="cuda", shapes_only=True)
def test_perf_counter_around_a_synchronized_matmul_loop_measures_the_predicted_time():
    from accel.sim.cuda.timing import costs

    clock = _follow_the_gpu_clock()
    a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    host, real = clock.host, real_time.perf_counter()
    start, wall = time.perf_counter(), time.time()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    meta = torch.empty(16384, 16384, dtype=torch.bfloat16, device="meta")
    one = costs.duration(clock.card, aten.mm.default, "matmul", (meta, meta), {}, meta)[0]
    assert elapsed == pytest.approx(clock.host - host, rel=1e-9)
    assert elapsed == pytest.approx(50 * one, rel=1e-6)  # the GPU's work: the host's launches hide behind it
    assert time.time() - wall == pytest.approx(elapsed, abs=1e-5)
    assert real_time.perf_counter() - real < elapsed / 4  # shapes only: this host computed none of it


def _read_the_clocks():
    clock = _follow_the_gpu_clock()
    before = time.monotonic_ns()
    torch.ones(1024, device="cuda").sum().item()  # a kernel, and the host waits for it
    return time.monotonic_ns() - before, clock.host > 0


def _clocks_are_real():
    torch.zeros(1, device="cuda")
    return time.perf_counter is real_time.perf_counter and time.time_ns is real_time.time_ns


def test_the_next_task_of_a_warm_rank_reads_real_time_again():
    for elapsed, ran in accel.sim.launch(_read_the_clocks, world_size=2, device="cuda"):
        assert ran and 0 < elapsed < 1e6  # nanoseconds of the simulated host: a few microseconds
    assert accel.sim.launch(_clocks_are_real, world_size=2, device="cuda") == [True, True]


def _wait_for_simulated_time():
    _follow_the_gpu_clock()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # no op runs: simulated time never gets there
        time.sleep(0.01)


def test_a_rank_waiting_for_simulated_time_is_stopped_by_the_launch_timeout_in_real_seconds():
    # warm ranks first: a fresh rank's first task imports much of torch, which the timeout would count
    assert accel.sim.launch(_clocks_are_real, world_size=2, device="cuda") == [True, True]
    start = real_time.monotonic()
    with pytest.raises(accel.sim.DistributedTimeout, match="timed out after 3 s") as raised:
        accel.sim.launch(_wait_for_simulated_time, world_size=2, device="cuda", timeout=3)
    assert real_time.monotonic() - start < 30  # the ranks' stacks and their end take a few seconds more
    assert "_wait_for_simulated_time" in str(raised.value)  # each rank's stack


def _train(steps=4):
    from accel.sim.cuda.timing import clock

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 256, device="cuda")
    for _ in range(steps):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [step.time_s for step in clock.current().steps]


def _check_report(path, times, card):
    report = json.loads(path.read_text())
    assert "stale" not in report and report["card"] == card
    assert sorted(report["ranks"]) == ["0", "1"]
    for rank in (0, 1):
        steps = report["ranks"][str(rank)]["steps"]
        assert len(steps) == 3 and all(step["flops"] > 0 for step in steps)  # between four optimizer steps
        if times is not None:
            assert [step["time_s"] for step in steps] == times[rank]


def test_launch_has_the_ranks_write_the_timing_report(tmp_path, capfd):
    path = tmp_path / "timing.json"
    path.write_text('{"stale": true}')  # a report of an earlier run is replaced
    times = accel.sim.launch(_train, world_size=2, device="cuda", gpu="L4", timing_report=path)
    _check_report(path, times, "NVIDIA L4")
    assert "accel.sim: rank 1 on NVIDIA L4: predicted step" in capfd.readouterr().out


def _decorated_test_in_a_rank(path):
    from harness.decorator import spec_of

    def body():
        _train()

    decorated = distributed_test(world_size=2, device="cuda", timing_report=path)(body)
    spec_of(decorated).body()  # as harness.remote calls a test's body in each rank


def test_the_decorator_has_the_ranks_write_the_timing_report(tmp_path):
    path = tmp_path / "timing.json"
    accel.sim.launch(_decorated_test_in_a_rank, (str(path),), world_size=2, device="cuda")
    _check_report(path, None, "NVIDIA H100 80GB HBM3")


def test_a_timing_report_needs_simulated_gpus(tmp_path):
    path = tmp_path / "timing.json"
    needs = r"timing_report='.*timing.json' holds the simulated GPUs' predicted step times: it needs device='cuda'"
    with pytest.raises(ValueError, match=needs + r" \(simulated\), got 'cpu'"):
        accel.sim.launch(_train, device="cpu", timing_report=path)
    with pytest.raises(ValueError, match=needs):
        accel.sim.launch(_train, device="cuda", real_device=True, timing_report=path)
    with pytest.raises(ValueError, match="no folder"):
        accel.sim.launch(_train, device="cuda", timing_report=tmp_path / "missing" / "timing.json")
    with pytest.raises(ValueError, match="@distributed_test: " + needs):
        distributed_test(device=["cpu", "xla"], timing_report=path)
