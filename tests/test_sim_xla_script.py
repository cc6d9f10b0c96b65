"""`accel launch --simulate xla`: a torch_xla program as its docs write one, and its TPU bugs, on 2 and 4 cores."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # each test is a whole `accel launch --simulate xla`: make test-frameworks runs it

LAUNCH = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "xla", "--num_processes"]

#: torch_xla's multi-process training, as in its docs (torch_xla.launch, torch_xla.device, MpDeviceLoader,
#: xm.optimizer_step, torch_xla.sync)
TRAIN = """
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr


def _mp_fn(index):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    sampler = torch.utils.data.distributed.DistributedSampler(
        data, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=False
    )
    loader = pl.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler), device)
    for inputs, targets in loader:
        assert inputs.device == device
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        xm.optimizer_step(optimizer)
    torch_xla.sync()
    weights = xm.all_gather(model[0].weight.detach().flatten()[None])
    same = all(torch.equal(weights[0].cpu(), row.cpu()) for row in weights)
    print(f"ordinal {xr.global_ordinal()} of {xr.world_size()} on {device}: {loss.device} replicas equal {same}")


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=())
"""

BUGS = {
    "batch left on the host": (
        "model = torch.nn.Linear(4, 2).to(torch_xla.device())\nmodel(torch.randn(3, 4))",
        "RuntimeError: Expected XLA tensor. Got: CPUFloatType",
    ),
    "CPU tensor in forward": (
        "x = torch.randn(3, 4, device=torch_xla.device())\ntorch.mm(x, torch.randn(4, 4))",
        "RuntimeError: Expected XLA tensor. Got: CPUFloatType",
    ),
    ".numpy() on the device": (
        "torch.ones(3, device=torch_xla.device()).numpy()",
        "TypeError: can't convert xla:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
        "memory first.",
    ),
}


def _run(script: str, world_size: int, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.run([*LAUNCH, str(world_size), str(path)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_torch_xla_program_trains_on_simulated_tpu_cores(world_size, tmp_path):
    result = _run(TRAIN, world_size, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for ordinal in range(world_size):
        assert f"ordinal {ordinal} of {world_size} on xla:0: xla:0 replicas equal True" in output, output[-3000:]
    assert "simxla" not in output and "privateuse" not in output.lower()


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_tpu_bugs_fail_with_torch_xlas_words(bug, tmp_path):
    # (on 2 and 4 cores in a rank as well: tests/multiproc/test_sim_xla_tensors.py)
    code, message = BUGS[bug]
    result = _run(f"import torch\nimport torch_xla\n{code}\n", 2, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert message in output, output[-3000:]
    assert "simxla" not in output
