"""The libraries people launch, unchanged, on 2 simulated GPUs: Accelerate (its own test scripts and
a training script of its users), and the Transformers Trainer.

Each program is launched as its users launch it (`accel launch --simulate cuda`, as they would
run `accelerate launch` / `torchrun` on a GPU node) and compared with the same program on 2
CPU ranks: the simulated GPUs must give the GPU's branches (MULTI_GPU / FSDP, cuda devices)
and the CPU's numbers in fp32.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest

# whole launches of Accelerate / the Trainer on simulated GPUs: CI's second step (make test-frameworks)
pytestmark = pytest.mark.frameworks

PROGRAMS = Path(__file__).resolve().parent / "programs"
ACCELERATE_SCRIPTS = Path(accelerate.__file__).resolve().parent / "test_utils" / "scripts"


def launch(device, program, *args, processes=2):
    """Run `program` on `processes` simulated `device` ranks; its output (the run must succeed).

    On CPU ranks Accelerate is told to use the CPU, as `accelerate launch --cpu` tells it.
    """
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", device]
    command += ["--num_processes", str(processes), str(program), *map(str, args)]
    env = dict(os.environ, ACCELERATE_USE_CPU="true") if device == "cpu" else None
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "simcuda" not in output and "privateuse" not in output.lower(), output[-4000:]
    return output


def result_of(output):
    lines = [line for line in output.splitlines() if "RESULT " in line]
    assert len(lines) == 1, output[-4000:]
    return json.loads(lines[0].split("RESULT ", 1)[1])


# Accelerate's own distributed test scripts (those that need no download and no extra library).
@pytest.mark.parametrize(
    "script",
    ["test_script", "test_ops", "test_sync", "test_distributed_data_loop", "test_ddp_comm_hook", "test_merge_weights"],
)
def test_accelerates_own_scripts_pass_on_simulated_gpus(script):
    launch("cuda", ACCELERATE_SCRIPTS / f"{script}.py")


def test_an_accelerate_training_script_gives_the_cpu_numbers(tmp_path):
    gpu = result_of(launch("cuda", PROGRAMS / "accelerate_train.py", "--out", tmp_path / "gpu"))
    cpu = result_of(launch("cpu", PROGRAMS / "accelerate_train.py", "--out", tmp_path / "cpu"))
    assert gpu["distributed_type"] == "DistributedType.MULTI_GPU"
    assert cpu["distributed_type"] == "DistributedType.MULTI_CPU"
    assert gpu["device"] == gpu["state_device"] == "cuda:0"
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-5, abs=1e-6)
    assert gpu["seen"] == [float(i) for i in range(10)] == cpu["seen"]  # each sample once, in order
    assert gpu["ranks"] == [0, 1] and gpu["reloaded_equal"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accelerate_mixed_precision_on_simulated_gpus(tmp_path, precision):
    out = result_of(launch("cuda", PROGRAMS / "accelerate_train.py", "--mixed_precision", precision, "--out", tmp_path))
    assert out["device"] == "cuda:0" and out["reloaded_equal"] and out["seen"] == [float(i) for i in range(10)]
    assert out["losses"][-1] < out["losses"][0]


def test_accelerates_fsdp2_plugin_on_simulated_gpus(tmp_path):
    out = result_of(launch("cuda", PROGRAMS / "accelerate_train.py", "--fsdp2", "--out", tmp_path / "fsdp"))
    ddp = result_of(launch("cuda", PROGRAMS / "accelerate_train.py", "--out", tmp_path / "ddp"))
    assert out["distributed_type"] == "DistributedType.FSDP" and out["param_type"] == "DTensor"
    assert out["losses"] == pytest.approx(ddp["losses"], rel=1e-4, abs=1e-6)  # fp32 FSDP2 = DDP
    assert out["reloaded_equal"] and (tmp_path / "fsdp" / "state").is_dir()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_trainer_trains_evaluates_and_saves_on_simulated_gpus(tmp_path, precision):
    out = result_of(launch("cuda", PROGRAMS / "trainer_gpt2.py", "--precision", precision, "--out", tmp_path))
    assert out["device"] == out["param_device"] == "cuda:0" and out["world_size"] == 2
    assert out["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert "model.safetensors" in out["saved"] and "config.json" in out["saved"]
    assert 3.0 < out["train_loss"] < 4.5 and 3.0 < out["eval_loss"] < 4.5  # about ln(64) for an untrained model
    if precision == "fp32":
        cpu = result_of(launch("cpu", PROGRAMS / "trainer_gpt2.py", "--out", tmp_path / "cpu"))
        assert out["train_loss"] == pytest.approx(cpu["train_loss"], rel=1e-5)
        assert out["eval_loss"] == pytest.approx(cpu["eval_loss"], rel=1e-5)


def test_the_trainer_in_one_process_seeing_two_gpus_uses_data_parallel(tmp_path):
    # `python train.py` on a host with 2 GPUs: the Trainer wraps the model in nn.DataParallel
    def run(gpus, *args):
        command = [sys.executable, "-m", "accel.commands.cli", "run", "--simulate", "cuda", "--gpus", str(gpus)]
        command += ["--", sys.executable, str(PROGRAMS / "trainer_gpt2.py"), *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        return result_of(result.stdout + result.stderr)

    parallel = run(2, "--out", tmp_path / "dp")
    assert parallel["n_gpu"] == 2 and parallel["model_class"] == "DataParallel"
    assert parallel["parallel_mode"] == "ParallelMode.NOT_DISTRIBUTED" and parallel["world_size"] == 1
    one = run(1, "--out", tmp_path / "one", "--batch", "8")  # the same 8 samples a step, on one GPU
    assert one["n_gpu"] == 1 and one["model_class"] == "GPT2LMHeadModel"
    assert parallel["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert parallel["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
