"""Lightning (Fabric and the Trainer), unchanged, on simulated GPUs.

Each program in `tests/programs/lightning_*.py` is launched as Lightning's users launch it on
a GPU node (`accel launch --simulate cuda`, as they would run `torchrun`): Lightning sees
torchrun's environment, takes it (`TorchElasticEnvironment`) and runs one GPU per rank. The
same file is then launched on CPU ranks (`--simulate cpu`), where it picks the CPU
accelerator itself; in fp32 the simulated GPUs must give the CPU ranks' numbers: the loss of
every step, the validation losses and the trained weights, to the last bit (the simulator
computes with the CPU's kernels, and its "nccl" collectives sum as Gloo does for these sizes).
bf16-mixed is compared with fp32 within bf16's precision.
"""

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.frameworks

PROGRAMS = Path(__file__).resolve().parent / "programs"
FABRIC = PROGRAMS / "lightning_fabric_train.py"
TRAINER = PROGRAMS / "lightning_trainer_train.py"
LINE = re.compile(r"^(?:\[rank (\d+)\] )?(STEP|VAL|RESULT|CHECKSUM) (\{.*\})$")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`run(device, program, *args, processes=2)`: the parsed output of one launch, each launch made once per module."""

    @functools.cache
    def launch(device, program, *args, processes=2):
        out = tmp_path_factory.mktemp(f"{Path(program).stem}-{device}")
        command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", device]
        command += ["--num_processes", str(processes), str(program), *args, "--out", str(out)]
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "CUDA_"))
        }
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out, timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        assert "simcuda" not in output and "privateuse" not in output.lower(), output[-6000:]
        return parse(output, processes)

    return launch


def parse(output, processes):
    """The run's step losses, validation losses and result (rank 0's lines) and each rank's checksum."""
    lines = {"STEP": [], "VAL": [], "RESULT": [], "CHECKSUM": []}
    for line in output.splitlines():
        match = LINE.match(line.strip())
        if match:
            rank, kind, payload = match.groups()
            lines[kind].append((int(rank or 0), json.loads(payload)))
    assert len(lines["RESULT"]) == 1, output[-6000:]
    (rank, result), *_ = lines["RESULT"]
    assert rank == 0
    assert {rank for rank, _ in lines["STEP"] + lines["VAL"]} <= {0}, "only rank 0 reports losses"
    assert [step["step"] for _, step in lines["STEP"]] == list(range(len(lines["STEP"])))
    checksums = {rank: checksum for rank, checksum in lines["CHECKSUM"]}
    assert sorted(checksums) == list(range(processes)) == sorted(c["rank"] for c in checksums.values())
    return {
        "steps": [step["loss"] for _, step in lines["STEP"]],
        "vals": [val["loss"] for _, val in lines["VAL"]],
        "result": result,
        "checksums": [{"sha256": checksums[r]["sha256"], "sum": checksums[r]["sum"]} for r in range(processes)],
    }


def assert_on_simulated_gpus(run, processes):
    result = run["result"]
    assert result["world_size"] == processes and result["device"] == "cuda:0"
    assert result["ranks_devices"] == [[rank, rank] for rank in range(processes)]  # rank k on cuda:k


def assert_ranks_agree(run):
    assert run["checksums"] == [run["result"]["trained"]] * len(run["checksums"]), run["checksums"]


# -- Fabric ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "processes", "wrapper"),
    [
        ("ddp", 2, "DistributedDataParallel"),
        ("fsdp", 2, "FullyShardedDataParallel"),
        ("fsdp", 4, "FullyShardedDataParallel"),
    ],
)
def test_fabric_fp32_gives_the_cpu_ranks_numbers(run, strategy, processes, wrapper):
    gpu = run("cuda", FABRIC, "--strategy", strategy, processes=processes)
    cpu = run("cpu", FABRIC, "--strategy", strategy, processes=processes)
    assert_on_simulated_gpus(gpu, processes)
    assert cpu["result"]["device"] == cpu["result"]["param_device"] == "cpu"
    assert gpu["result"]["param_device"] == "cuda:0" and gpu["result"]["wrapper"] == wrapper == cpu["result"]["wrapper"]
    assert gpu["result"]["output_dtypes"] == ["torch.float32"]
    assert len(gpu["steps"]) == 6 and all(math.isfinite(loss) for loss in gpu["steps"])
    assert gpu["steps"] == gpu["result"]["losses"]
    assert gpu["steps"] == cpu["steps"]  # every step's loss, to the bit
    assert gpu["result"]["trained"] == cpu["result"]["trained"]  # and the trained weights
    assert_ranks_agree(gpu)
    assert_ranks_agree(cpu)
    # fabric.save / fabric.load: a step after saving moves the weights, loading brings back the saved ones
    for result in gpu["result"], cpu["result"]:
        assert result["moved"] != result["trained"] and result["reloaded"] == result["trained"]
        assert result["remainder"] == {"step": 6}


def test_fabric_fsdp_with_an_auto_wrap_policy_gives_the_cpu_ranks_numbers(run):
    """Each Linear its own FSDP unit: the root FSDP then holds no parameter of its own."""
    gpu = run("cuda", FABRIC, "--strategy", "fsdp", "--wrap")
    cpu = run("cpu", FABRIC, "--strategy", "fsdp", "--wrap")
    assert_on_simulated_gpus(gpu, 2)
    assert gpu["steps"] == cpu["steps"] and gpu["result"]["trained"] == cpu["result"]["trained"]
    assert_ranks_agree(gpu)
    assert gpu["result"]["reloaded"] == gpu["result"]["trained"] != gpu["result"]["moved"]


@pytest.mark.parametrize(("strategy", "precision"), [("ddp", "MixedPrecision"), ("fsdp", "FSDPPrecision")])
def test_fabric_bf16_mixed_on_simulated_gpus(run, strategy, precision):
    gpu = run("cuda", FABRIC, "--strategy", strategy, "--precision", "bf16-mixed")
    fp32 = run("cpu", FABRIC, "--strategy", strategy)
    assert_on_simulated_gpus(gpu, 2)
    result = gpu["result"]
    assert result["precision"] == precision and result["output_dtypes"] == ["torch.bfloat16"]
    assert result["param_device"] == "cuda:0"
    assert_ranks_agree(gpu)
    # it trained as fp32 did, within bf16's precision, and not by running fp32
    assert gpu["steps"] == pytest.approx(fp32["steps"], rel=2e-2)
    assert gpu["steps"] != fp32["steps"]
    assert result["trained"]["sum"] == pytest.approx(fp32["result"]["trained"]["sum"], rel=2e-2)
    assert result["moved"] != result["trained"] and result["reloaded"] == result["trained"]


# -- the Trainer ----------------------------------------------------------------------------------


def assert_trainer_checkpoints(result):
    """Validation after each epoch, ModelCheckpoint's files, `last.ckpt` holds the trained weights,
    and validating the best checkpoint (which loads it) gives the best score again."""
    assert result["files"] == ["best.ckpt", "epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert result["last_checkpoint"] == result["trained"] and result["last_checkpoint_step"] == 8
    assert result["best_score"] == min(result["val_losses"])
    assert result["validated_best"] == pytest.approx(result["best_score"], rel=1e-6)


def test_the_trainer_with_ddp_gives_the_cpu_ranks_numbers(run):
    gpu = run("cuda", TRAINER, "--strategy", "ddp")
    cpu = run("cpu", TRAINER, "--strategy", "ddp")
    assert_on_simulated_gpus(gpu, 2)
    assert gpu["result"]["param_devices"] == ["cuda:0"] and cpu["result"]["param_devices"] == ["cpu"]
    assert gpu["result"]["wrappers"] == ["DistributedDataParallel"] == cpu["result"]["wrappers"]
    assert len(gpu["steps"]) == 8 and len(gpu["vals"]) == 2  # 2 epochs of 4 steps, a validation after each
    assert gpu["steps"] == gpu["result"]["losses"] and gpu["vals"] == gpu["result"]["val_losses"]
    assert gpu["steps"] == cpu["steps"] and gpu["vals"] == cpu["vals"]
    assert gpu["result"]["trained"] == cpu["result"]["trained"]
    assert_ranks_agree(gpu)
    for result in gpu["result"], cpu["result"]:
        assert_trainer_checkpoints(result)
    # the GPU run's checkpoint records its tensors on cuda:0, as one written on a GPU does
    assert "cuda:0" in gpu["result"]["last_checkpoint_locations"]
    assert "cuda:0" not in cpu["result"]["last_checkpoint_locations"]


def test_the_trainer_with_fsdp_validates_and_checkpoints_on_simulated_gpus(run):
    """FSDP with Lightning's default full-state-dict checkpoints, saved by ModelCheckpoint.

    The reference is the same script with DDP on CPU ranks, as in fp32 one FSDP unit over 2
    ranks computes what DDP computes. With FSDP on CPU ranks, torch's FSDP1 crashes (SIGSEGV)
    in the full state dict Lightning takes: with `offload_to_cpu=True`,
    `FlatParamHandle.to_cpu()` "moves" the unsharded flat parameter to the CPU it is already
    on, then frees the unsharded storage the parameter still views, and the state dict's
    `clone()` reads freed memory.
    """
    gpu = run("cuda", TRAINER, "--strategy", "fsdp")
    ddp = run("cpu", TRAINER, "--strategy", "ddp")
    assert_on_simulated_gpus(gpu, 2)
    assert gpu["result"]["strategy"] == "Sharded" and gpu["result"]["wrappers"] == ["FullyShardedDataParallel"]
    assert gpu["result"]["param_devices"] == ["cuda:0"]
    assert gpu["steps"] == pytest.approx(ddp["steps"], rel=1e-6) and len(gpu["steps"]) == 8
    assert gpu["vals"] == pytest.approx(ddp["vals"], rel=1e-6) and len(gpu["vals"]) == 2
    assert gpu["result"]["trained"]["sum"] == pytest.approx(ddp["result"]["trained"]["sum"], rel=1e-6)
    assert_ranks_agree(gpu)
    assert_trainer_checkpoints(gpu["result"])
