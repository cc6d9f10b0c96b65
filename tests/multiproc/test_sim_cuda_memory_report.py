"""What uses a simulated GPU's memory: the whole run's peak (whatever peak resets the script made),
what made it up by category and module (`accel.sim.memory_report()`), and the picture of a step.

The categories are decided as torch's MemTracker decides them (accel/sim/cuda/memory/report.py);
the bytes are the allocator's blocks, rounded as it rounds requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import accel.sim
from accel.sim.cuda.memory.allocator import format_size, round_size
from accel.sim.cuda.torch_cuda import properties as cuda_properties
from harness import distributed_test

MiB = 1 << 20
GiB = 1 << 30
ACCEL = str(Path(sys.executable).with_name("accel"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256)).cuda()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> int:
    """One training step after a peak reset (as torchtitan resets at each logged step); its own peak."""
    torch.cuda.reset_peak_memory_stats()
    model(torch.randn(batch, 256, device="cuda")).square().mean().backward()
    optimizer.step()
    return torch.cuda.max_memory_allocated()


@distributed_test(world_size=[2], device="cuda")
def test_the_end_of_run_peak_is_the_whole_runs_whatever_the_resets():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    first = _step(model, optimizer, 4096)  # the bigger batch first
    optimizer.zero_grad()
    second = _step(model, optimizer, 512)
    assert first > second == torch.cuda.max_memory_allocated() == accel.sim.peak_memory().allocated
    report = accel.sim.memory_report()
    assert report.peak_allocated == first and report.peak_reserved >= torch.cuda.max_memory_reserved()
    (line,) = cuda_properties.peak_report()
    assert f"peak allocated {format_size(first)}, peak reserved {format_size(report.peak_reserved)}" in line
    assert report.at_peak == {} and report.top_modules == []  # not asked: nothing followed


@distributed_test(world_size=[2], device="cuda", report_memory=True)
def test_a_training_step_is_broken_down_as_memtracker_does():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer, 1024)
    optimizer.zero_grad()
    _step(model, optimizer, 1024)  # the peak: in this backward, AdamW's state made by the first step
    report = accel.sim.memory_report()
    parameters = sum(round_size(p.nbytes) for p in model.parameters())
    assert report.at_peak["parameters"] == parameters == 2 * (2 * MiB) + 8 * 1024 + 1024
    assert report.at_peak["optimizer state"] == 2 * parameters  # exp_avg and exp_avg_sq (the step count: host)
    assert report.at_peak["activations"] > 0 and report.at_peak["temporaries"] > 0
    assert report.at_peak["collective buffers"] == report.at_peak["buffers"] == 0
    assert sum(report.at_peak.values()) == report.peak_allocated  # all of it, workspaces in "other"
    # after the step: its gradients, as large as the parameters; no activation left
    assert report.now["gradients"] == parameters and report.now["activations"] == report.now["temporaries"] == 0
    assert report.now["optimizer state"] == 2 * parameters
    # the ReLU's 1024 x 2048 output (8 MiB), and the last layer's weight with its gradient and AdamW state,
    # top the list; the first layer holds its weight and state (its output is not kept)
    names = [name for name, _ in report.top_modules]
    assert names[:2] == ["Sequential.1", "Sequential.2"] or names[:2] == ["Sequential.2", "Sequential.1"]
    assert dict(report.top_modules)["Sequential.0"] >= 2 * MiB  # its weight, at least
    lines = report.lines()
    assert lines[0].startswith(
        f"cuda:{torch.cuda.current_device()} at the peak ({format_size(report.peak_allocated)}):"
    )
    assert "optimizer state" in lines[0] and lines[1].startswith(f"cuda:{torch.cuda.current_device()} top modules")


@distributed_test(world_size=[2], device="cuda", report_memory=True)
def test_ddp_buckets_are_collective_buffers(local_rank):
    import torch.distributed as dist

    model = torch.nn.parallel.DistributedDataParallel(_model(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optimizer, 256)
    dist.barrier()
    report = accel.sim.memory_report()
    parameters = sum(round_size(p.nbytes) for p in model.parameters())
    # one bucket holds every gradient: as large as the parameters, give or take the rounding
    assert parameters - 4096 <= report.now["collective buffers"] <= parameters + 4096
    assert report.now["parameters"] == parameters and report.now["gradients"] == parameters


@distributed_test(world_size=[2], device="cuda", gpu="memory=1GiB,capability=8.0", report_memory=True)
def test_the_breakdown_at_out_of_memory_is_kept():
    kept = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    report = accel.sim.memory_report()
    assert report.out_of_memory_request == 2 * GiB
    assert report.at_out_of_memory["other"] == 300 * MiB and sum(report.at_out_of_memory.values()) == 300 * MiB
    assert "at the out-of-memory (tried to allocate 2.00 GiB): other 300.00 MiB" in report.lines()[-1]
    del kept


def _train() -> int:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    for batch in (2048, 512):
        _step(model, optimizer, batch)
        optimizer.zero_grad()
    return accel.sim.memory_report().peak_allocated


@pytest.mark.parametrize("suffix", [".html", ".svg"])
def test_the_picture_of_the_peaks_step_is_written_for_each_rank(tmp_path, suffix):
    path = tmp_path / f"memory{suffix}"
    peaks = accel.sim.launch(_train, world_size=2, device="cuda", report_memory=str(path))
    for rank in range(2):
        text = (tmp_path / f"memory.rank{rank}{suffix}").read_text()
        assert text.count("<polygon") >= 4  # parameters, gradients, optimizer state, activations, ...
        assert "optimizer state" in text and "peak" in text and f"rank {rank}, cuda:{rank}" in text
        if suffix == ".html":
            assert text.startswith("<!DOCTYPE html>") and "<table>" in text
        else:
            assert text.startswith("<svg")
    assert peaks[0] > 0
    with pytest.raises(ValueError, match="give a path ending in .html or .svg"):
        accel.sim.launch(_train, world_size=2, device="cuda", report_memory=str(tmp_path / "memory.png"))


SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256)).cuda()
optimizer = torch.optim.AdamW(model.parameters())
for batch in (2048, 512):
    torch.cuda.reset_peak_memory_stats()
    model(torch.randn(batch, 256, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("script peak", torch.cuda.max_memory_allocated(), flush=True)
"""


def test_accel_launch_memory_report_prints_the_breakdown_and_draws_the_step(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "CUDA_"))}
    done = subprocess.run(
        [ACCEL, "launch", "--simulate", "cuda", "--num_processes", "1", "--memory_report", "mem.html", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    script_peak = int(done.stdout.split("script peak ")[1].split()[0])
    line = next(line for line in done.stdout.splitlines() if "peak allocated" in line)
    whole_run = line.split("peak allocated ")[1].split(",")[0]
    assert whole_run != format_size(script_peak)  # the first, bigger step's peak, not the last one's
    assert "accel.sim: cuda:0 at the peak" in done.stdout and "activations" in done.stdout
    assert f"accel.sim: memory over the step of the peak, by category: {tmp_path / 'mem.html'}" in done.stdout
    assert (tmp_path / "mem.html").read_text().startswith("<!DOCTYPE html>")
    refused = subprocess.run(
        [ACCEL, "launch", "--simulate", "cpu", "--memory_report", "mem.html", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "--memory_report is about simulated GPUs" in refused.stderr
