"""On a host with real GPUs, simulation never reaches them (issue 27, item 4).

Checked without a GPU by tripwires: with a CUDA build of torch (CI's torch 2.14.1 run), every
C entry point that reaches the CUDA runtime or driver raises if called; a process on a simulated
node of 8 GPUs then trains, syncs, uses streams and asks for memory without calling any of them.
With a CPU build there is nothing to wire, and the run checks the node alone.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

PROGRAM = Path(__file__).parent / "programs" / "real_gpus_untouched.py"


def test_a_simulated_node_never_reaches_the_cuda_driver():
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_SIMULATE", "ACCEL_SIM_NODE")}
    done = subprocess.run(
        [sys.executable, str(PROGRAM), "cuda:8,gpu=A100-80GB"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["touched"] == []
    if torch.backends.cuda.is_built():  # a CUDA build: the driver's entry points were there to touch
        assert {"_cuda_init", "_cuda_getDeviceCount", "_cuda_setDevice", "_cuda_synchronize"} <= set(seen["wired"])
    assert (seen["count"], seen["current"], seen["param_device"]) == (8, 3, "cuda:3")
    assert seen["name"] == "NVIDIA A100-SXM4-80GB"
    assert seen["total"] == 84987084800  # the simulated card's, not the host's
    assert seen["peak"] > 64 * 64 * 4
