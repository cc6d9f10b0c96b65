"""`accel launch --simulate cuda --gpu NAME`: the card of the simulated GPUs, and each rank's peak memory at the end."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each test is a whole `accel launch`: make test-frameworks runs it

ACCEL = str(Path(sys.executable).with_name("accel"))

SCRIPT = """
import os, sys
# the idiom: each process sees only its own GPU, set before CUDA starts
os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
assert torch.cuda.device_count() == 1
x = torch.ones(64, 1024, 1024, device="cuda")  # 256 MiB
dist.all_reduce(x)
print(torch.cuda.get_device_name(), int(x[0, 0, 0]), flush=True)
if len(sys.argv) > 1:  # bytes to try to allocate
    try:
        torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as error:
        print("OOM", str(error).split(".")[0], flush=True)
dist.destroy_process_group()
sys.exit(0)  # as scripts end: the peak is reported all the same
"""


def _launch(tmp_path, *argv, script_args=()):
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "CUDA_"))}
    return subprocess.run(
        [ACCEL, "launch", *argv, "script.py", *script_args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_card_is_chosen_and_each_rank_reports_its_peak(tmp_path):
    # 23 GiB do not fit on an L4 (out of memory is raised before this host, which has less, is asked)
    done = _launch(tmp_path, "--simulate", "cuda", "--gpu", "L4", "--num_processes", "2", script_args=[str(23 << 30)])
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"[rank {rank}] NVIDIA L4 2" in done.stdout
        assert f"[rank {rank}] OOM CUDA out of memory" in done.stdout
        # each rank sees its GPU as cuda:0
        assert (
            f"[rank {rank}] accel.sim: cuda:0 (NVIDIA L4, 22.03 GiB): peak allocated 256.00 MiB, "
            "peak reserved 256.00 MiB (1.1% of the card)"
        ) in done.stdout


def test_the_default_card_is_an_h100(tmp_path):
    done = _launch(tmp_path, "--simulate", "cuda", "--num_processes", "2")
    assert done.returncode == 0, done.stderr
    assert "[rank 1] NVIDIA H100 80GB HBM3 2" in done.stdout
    assert "accel.sim: cuda:0 (NVIDIA H100 80GB HBM3, 79.19 GiB)" in done.stdout


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--simulate", "cuda", "--gpu", "B300"], "unknown GPU 'B300'; choose one of H100, H100-96GB, H100-PCIE, H200"),
        (["--simulate", "cpu", "--gpu", "L4"], "--gpu is about simulated GPUs: use it with --simulate cuda"),
        (["--simulate", "xla", "--shapes_only"], "--shapes_only is about simulated GPUs: use it with --simulate cuda"),
        (["--gpu", "L4"], "--gpu applies to simulated runs only"),
        (["--simulate", "cuda", "--network", "fast"], "cannot read the network 'fast': write each GPU's NIC as e.g."),
        (["--simulate", "cuda", "--gpus_per_node", "0"], "--gpus_per_node must be a positive number, got 0"),
        (["--simulate", "cpu", "--timing_report", "t.json"], "--timing_report is about simulated GPUs"),
        (["--tokens_per_step", "8"], "--tokens_per_step applies to simulated runs only"),
    ],
)
def test_a_bad_card_is_refused_before_anything_starts(tmp_path, argv, error):
    done = _launch(tmp_path, *argv)
    assert done.returncode == 2 and error in done.stderr
