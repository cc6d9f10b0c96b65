"""Scripts written for torchrun on GPUs run unchanged under `accel launch --simulate`.

`examples/plain_ddp.py` has no accel in it: it reads torchrun's environment, calls
`init_process_group("nccl")` itself, pins its GPU, trains with DDP(device_ids=[local_rank])
and all-reduces a metric built on the GPU. On simulated GPUs it must run as on real
ones, and train exactly as the same script on CPU ranks with Gloo.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each test is a whole `accel launch` or torchrun: make test-frameworks runs it

ACCEL = str(Path(sys.executable).with_name("accel"))
EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "plain_ddp.py")
LINE = re.compile(r"rank (\d)/2 backend=(\S+) device=(\S+) mean_loss=(\S+) checksum=(\S+)")


def _launch(device, *script_args, cwd):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    done = subprocess.run(
        [ACCEL, "launch", "--simulate", device, "--num_processes", "2", EXAMPLE, *script_args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = sorted(LINE.findall(done.stdout))
    assert [rank for rank, *_ in found] == ["0", "1"], done.stdout
    return found


def test_plain_torchrun_script_on_simulated_gpus_trains_as_on_cpu_ranks(tmp_path):
    gpu = _launch("cuda", cwd=tmp_path)  # the script's default on GPUs: init_process_group("nccl")
    assert [(backend, device) for _, backend, device, _, _ in gpu] == [("nccl", "cuda:0"), ("nccl", "cuda:1")]
    cpu = _launch("cpu", "--backend", "env", cwd=tmp_path)  # init_method="env://" on CPU ranks: Gloo
    assert [(backend, device) for _, backend, device, _, _ in cpu] == [("gloo", "cpu"), ("gloo", "cpu")]
    # the same losses and the same weights, to the last printed digit, on every rank
    assert {(loss, checksum) for *_, loss, checksum in gpu} == {(loss, checksum) for *_, loss, checksum in cpu}
    assert len({(loss, checksum) for *_, loss, checksum in gpu}) == 1


FORGETFUL = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
if "--pin" in sys.argv:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
total = torch.ones(1, device="cuda")
dist.all_reduce(total)
print(f"rank {dist.get_rank()} on cuda:{torch.cuda.current_device()} total={total.item()}", flush=True)
dist.destroy_process_group()
"""


def test_a_forgotten_set_device_fails_as_on_gpus(tmp_path):
    # Each process of a GPU host starts on cuda:0: without set_device(local_rank) both ranks
    # bring GPU 0 to the NCCL group, which NCCL refuses.
    script = tmp_path / "forgetful.py"
    script.write_text(FORGETFUL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_"))}

    def run(*args):
        command = [ACCEL, "launch", "--simulate", "cuda", "--num_processes", "2", str(script), *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

    forgot = run()
    assert forgot.returncode != 0, forgot.stdout + forgot.stderr
    assert "Duplicate GPU detected" in forgot.stdout + forgot.stderr
    pinned = run("--pin")
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr
    assert "rank 0 on cuda:0 total=2.0" in pinned.stdout and "rank 1 on cuda:1 total=2.0" in pinned.stdout
