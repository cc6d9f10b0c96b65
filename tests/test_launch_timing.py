"""`accel launch --simulate cuda` predicts the step time: each rank's end-of-run line, and the timing report."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ACCEL = str(Path(sys.executable).with_name("accel"))

SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024).cuda().bfloat16())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
for _ in range(4):
    model(x).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""


def test_each_rank_prints_its_predicted_step_and_writes_the_report(tmp_path):
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "report.json").write_text('{"stale": true}')  # a report of an earlier run is replaced
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "CUDA_"))}
    argv = ["--simulate", "cuda", "--num_processes", "2", "--gpu", "A100-80GB", "--network", "200Gbps"]
    argv += ["--timing_report", "report.json", "--tokens_per_step", "512", "--timing_trace", "trace.json"]
    done = subprocess.run(
        [ACCEL, "launch", *argv, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["card"] == "NVIDIA A100-SXM4-80GB" and report["network"] == "200Gbps" and "stale" not in report
    for rank in (0, 1):
        steps = report["ranks"][str(rank)]["steps"]
        assert len(steps) == 3 and all(step["flops"] == 2 * 2 * 256 * 1024 * 1024 for step in steps)
        median = sorted(step["time_s"] for step in steps)[1]
        line = f"[rank {rank}] accel.sim: rank {rank} on NVIDIA A100-SXM4-80GB: predicted step {median * 1e3:.3g} ms"
        assert line in done.stdout
        assert f"{512 / median / 2:,.0f} tokens/s per GPU" in done.stdout
        # the last step as Perfetto reads it: a track per stream, kernels by op, DDP's all-reduce on NCCL's
        trace = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        tracks = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
        assert tracks == {f"cuda:{rank} stream 0 (default)", f"cuda:{rank} NCCL group 1"}
        kernels = [e for e in trace if e["ph"] == "X"]
        assert {"addmm", "mm", "nccl all_reduce"} <= {e["args"]["op"] for e in kernels}
        # named by module in forward (the Linear is DDP's `module`), by autograd node in backward
        assert "addmm (module)" in {e["name"] for e in kernels}
        assert "mm (AddmmBackward0)" in {e["name"] for e in kernels}
        assert all(e["ts"] >= 0 and e["ts"] + e["dur"] <= median * 1e6 + 1e-3 for e in kernels)
        assert "<svg" in (tmp_path / f"trace.rank{rank}.svg").read_text()
