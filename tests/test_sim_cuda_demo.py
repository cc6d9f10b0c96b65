"""`make demo`: the regression example on simulated GPUs reports them and learns the true weights."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each test is a whole `accel launch`: make test-frameworks runs it

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


PINNED_BY_THE_MESH = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
rank = int(os.environ["LOCAL_RANK"])
acc = torch.accelerator.current_accelerator()
device = torch.device(f"{acc}:{rank}")
assert not torch.cuda.is_initialized()  # a new process has not used CUDA yet
dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device)
assert not torch.cuda.is_initialized()  # NCCL's eager set-up does not start Python's CUDA
mesh = init_device_mesh(acc.type, (dist.get_world_size(),))
assert torch.cuda.is_initialized() and torch.cuda.current_device() == rank  # the mesh pinned LOCAL_RANK
x = torch.ones(2, device=acc)
dist.all_reduce(x)
print("OK", x.device, x.tolist())
dist.destroy_process_group()
"""


def test_a_device_mesh_pins_the_gpu_of_local_rank_in_a_fresh_process(tmp_path):
    # PyTorch's FSDP2 example never calls set_device: DeviceMesh does it, as CUDA is not yet initialised
    script = tmp_path / "mesh.py"
    script.write_text(PINNED_BY_THE_MESH)
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--num_processes", "2"]
    result = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "[rank 1] OK cuda:1 [2.0, 2.0]" in output and "[rank 0] OK cuda:0 [2.0, 2.0]" in output
