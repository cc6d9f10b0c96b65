"""`make demo`: the regression example on simulated GPUs reports them and learns the true weights."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_regression.py"


def test_demo_runs_on_simulated_gpus():
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--num_processes", "2"]
    result = subprocess.run([*command, str(EXAMPLE), "--epochs", "3"], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Distributed environment: MULTI_GPU" in output and "Device: cuda:0" in output
    assert "result check: OK" in output
    # DDP on a GPU prints no warnings; nothing may name the device under the simulated GPUs
    assert "Warning" not in output and "simcuda" not in output, output[-3000:]
