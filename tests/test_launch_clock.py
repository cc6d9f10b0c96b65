"""`accel launch --simulate cuda --clock gpu`: a script's own throughput log, timed with `time.perf_counter`,
prints the predicted figures, the same as the timing report's steps."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ACCEL = str(Path(sys.executable).with_name("accel"))

SCRIPT = """
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda().bfloat16())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
for step in range(4):
    start = time.perf_counter()  # as torchtitan times its steps
    model(x).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"step {step}: {seconds!r} s, {8192 / seconds:.1f} samples/s", flush=True)
dist.destroy_process_group()
"""


def _launch(tmp_path, *argv):
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "CUDA_"))}
    return subprocess.run(
        [ACCEL, "launch", "--simulate", "cuda", "--num_processes", "2", *argv, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_scripts_own_throughput_is_the_predicted_one(tmp_path):
    # shapes only: matmuls big enough that the GPU, not the host's launches, sets the pace (in no time here)
    done = _launch(tmp_path, "--clock", "gpu", "--shapes_only", "--timing_report", "report.json")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    for rank in (0, 1):
        printed = [float(s) for s in re.findall(rf"\[rank {rank}\] step \d: (\S+) s", done.stdout)]
        assert len(printed) == 4
        # the steps between optimizer steps, as the clock has them: the script's last three measured them
        predicted = [step["time_s"] for step in report["ranks"][str(rank)]["steps"]]
        assert printed[1:] == pytest.approx(predicted, rel=1e-6)
        assert f"[rank {rank}] step 3: {printed[3]!r} s, {8192 / printed[3]:.1f} samples/s" in done.stdout


def test_the_clock_refused_where_it_does_not_apply(tmp_path):
    done = _launch(tmp_path, "--clock", "off", "--timing_trace", "trace.json")
    assert done.returncode == 2
    assert "--timing_trace reports on the simulated clock, which --clock off stops" in done.stderr
