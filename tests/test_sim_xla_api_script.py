"""A TPU training script written as torch_xla's docs write it runs unchanged under
`accel launch --simulate xla --num_processes N`: `torch_xla.launch(_mp_fn)` runs `_mp_fn(index)`
once in each simulated core, and data-parallel training with `MpDeviceLoader` and
`xm.optimizer_step` gives every core the weights of one process training on the whole batch.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each test is a whole `accel launch --simulate xla`: make test-frameworks runs it

ACCEL = str(Path(sys.executable).with_name("accel"))

SCRIPT = """
import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def make_dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g))


def reference_checksum(world_size, epochs, batch_size):
    # One process, each step on the samples every core sees at that step.
    model, dataset = make_model(), make_dataset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    indices = list(range(len(dataset)))
    per_core = [indices[r::world_size] for r in range(world_size)]
    for _ in range(epochs):
        for start in range(0, len(per_core[0]), batch_size):
            batch = [i for core in per_core for i in core[start:start + batch_size]]
            x, y = dataset[batch]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return sum(p.sum() for p in model.parameters()).item()


def _mp_fn(index, epochs, batch_size):
    device = torch_xla.device()
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=False)
    train_loader = pl.MpDeviceLoader(DataLoader(dataset, batch_size=batch_size, sampler=sampler), device)
    losses = []
    for epoch in range(epochs):
        model.train()
        for step, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(data), target)
            loss.backward()
            xm.optimizer_step(optimizer)
            xm.add_step_closure(lambda loss: losses.append(loss.item()), args=(loss,))
    torch_xla.sync()
    checksum = sum(p.sum() for p in model.parameters()).cpu().item()
    mean_first = xm.mesh_reduce("first_loss", losses[0], lambda items: sum(items) / len(items))
    xm.master_print(f"reference={reference_checksum(xr.world_size(), epochs, batch_size):.6f}", flush=True)
    print(f"core {index}/{xr.world_size()} device={device} steps={len(losses)} checksum={checksum:.6f} "
          f"first={mean_first:.6f} last={losses[-1]:.6f}", flush=True)


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=(3, 4))
"""

LINE = re.compile(r"core (\d)/(\d) device=(\S+) steps=(\d+) checksum=(\S+) first=(\S+) last=(\S+)")


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_torch_xla_training_script_runs_unchanged_on_simulated_tpu_cores(world_size, tmp_path):
    script = tmp_path / "train_tpu.py"
    script.write_text(SCRIPT)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    done = subprocess.run(
        [ACCEL, "launch", "--simulate", "xla", "--num_processes", str(world_size), str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cores = sorted(LINE.findall(done.stdout))
    assert [(int(i), int(n)) for i, n, *_ in cores] == [(i, world_size) for i in range(world_size)], done.stdout
    steps = 3 * (64 // world_size // 4)
    assert {(device, int(count)) for _, _, device, count, *_ in cores} == {("xla:0", steps)}
    # every core holds the same weights: those of one process training on the whole batch
    checksums = {float(checksum) for *_, checksum, _, _ in cores}
    assert len(checksums) == 1
    (reference,) = re.findall(r"\breference=(\S+)$", done.stdout, re.MULTILINE)
    assert checksums.pop() == pytest.approx(float(reference), abs=2e-5)
    first, last = float(cores[0][5]), float(cores[0][6])
    assert last < first
