"""DeepSpeed, unchanged, on simulated GPUs: directly, through Accelerate and through the Transformers Trainer.

Each program in `tests/programs/deepspeed_*.py` is launched as DeepSpeed's users launch it on a
GPU node (`accel launch --simulate cuda`, as they would run `torchrun` / `deepspeed` /
`accelerate launch`), and trains the same model several times in one launch: with DDP and
with ZeRO stages 0 to 3 (see each program). In fp32 every ZeRO stage must give DDP's
losses, gradient norms and trained weights to float rounding (DeepSpeed's FusedAdam, a
stand-in in torch ops on simulated GPUs, rounds as torch's AdamW does, not bit for bit),
the stages must give each other's, every rank must hold the same full weights, and ZeRO
must have partitioned Adam's state over the ranks. bf16 runs must train (the held-out loss
falls), agree across ranks and stay within bf16's precision of fp32.

The same `deepspeed_direct.py` launches were run by hand on CPU ranks (`accel launch
--simulate cpu`: DeepSpeed picks its CPU accelerator, which compiles its own CPU FusedAdam
and shared-memory all-reduce, two minutes, too slow for this file): DDP's losses and weights
equal the simulated GPUs' to the bit; ZeRO's losses are within 2e-7 relative on 2 and 4
ranks (DeepSpeed's CPU Adam kernel rounds apart from torch's ops), bf16's and fp16's are
equal to the bit, and the stages agree there as here. Accelerate and the Trainer do not run
DeepSpeed on CPU ranks (with ACCELERATE_USE_CPU both drop it for DDP), so their references
are their own DDP runs in the same launch.
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

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.frameworks

PROGRAMS = Path(__file__).resolve().parent / "programs"
DIRECT = PROGRAMS / "deepspeed_direct.py"
ACCELERATE = PROGRAMS / "deepspeed_accelerate.py"
TRAINER = PROGRAMS / "deepspeed_trainer.py"
LINE = re.compile(r"^(?:\[rank (\d+)\] )?(STEP|RESULT|CHECKSUM|INITIAL) (\{.*\})$")
ZERO = ["zero1", "zero2", "zero3"]
FP32 = {"rel": 1e-5, "abs": 1e-6}  # two float32 computations of the same steps, summed in other orders


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`run(program, *args, processes=2)`: the parsed output of one launch on simulated GPUs, made once per module."""

    @functools.cache
    def launch(program, *args, processes=2):
        out = tmp_path_factory.mktemp(f"{Path(program).stem}-{processes}")
        extensions = out / "torch_extensions"
        command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda"]
        command += ["--num_processes", str(processes), str(program), *args, "--out", str(out)]
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ACCEL_", "ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_"))
            and not k.startswith("CUDA_")
        }
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out, timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        assert "simcuda" not in output and "privateuse" not in output.lower(), output[-6000:]
        # DeepSpeed's kernels came from the stand-ins: nothing was compiled
        assert not extensions.exists() or not any(extensions.iterdir()), sorted(extensions.iterdir())
        return parse(output, processes)

    return launch


def parse(output, processes):
    """Each run's result (rank 0's line), its STEP lines and each rank's checksum, by run name."""
    runs, steps, checksums, initial = {}, {}, {}, None
    for line in output.splitlines():
        match = LINE.match(line.strip())
        if not match:
            continue
        rank, kind, payload = int(match.group(1) or 0), match.group(2), json.loads(match.group(3))
        if kind == "INITIAL":
            initial = payload
        elif kind == "RESULT":
            assert rank == 0 and payload["run"] not in runs, line
            runs[payload["run"]] = payload
        elif kind == "STEP":
            assert rank == 0, line
            steps.setdefault(payload["run"], []).append(payload)
        else:
            checksums.setdefault(payload["run"], {})[payload["rank"]] = payload
    assert runs, output[-6000:]
    for name, result in runs.items():
        assert [s["step"] for s in steps[name]] == list(range(len(steps[name])))
        assert [s["loss"] for s in steps[name]] == result["losses"]
        assert sorted(checksums[name]) == list(range(processes)), checksums[name]
        result["checksums"] = [checksums[name][r] for r in range(processes)]
        result["initial"] = initial
    return runs


def weights(checksum):
    return {"sha256": checksum["sha256"], "sum": checksum["sum"], "abs": checksum["abs"]}


def assert_ranks_agree(result):
    """Every rank holds the same full weights (gathered under ZeRO-3), those rank 0 reported."""
    assert [weights(c) for c in result["checksums"]] == [weights(result["trained"])] * len(result["checksums"])


def assert_same_training(result, reference, weights_rel=1e-5):
    """Two fp32 runs of the same steps: the same losses and trained weights, to float rounding."""
    assert result["losses"] == pytest.approx(reference["losses"], **FP32), (result["run"], reference["run"])
    for key in "sum", "abs":
        assert result["trained"][key] == pytest.approx(reference["trained"][key], rel=weights_rel, abs=1e-5), key


def assert_trains(result):
    assert all(math.isfinite(loss) for loss in result["losses"]) and len(result["losses"]) >= 6
    assert math.isfinite(result["trained"]["sum"])
    assert_ranks_agree(result)


# -- deepspeed.initialize -------------------------------------------------------------------------


def assert_direct_zero(result, processes, stage, dtype="torch.float32"):
    assert result["world_size"] == processes and result["accelerator"] == "cuda" and result["backend"] == "nccl"
    assert result["engine"] == "DeepSpeedEngine" and result["zero_stage"] == stage
    assert result["basic_optimizer"] == "FusedAdam"  # DeepSpeed's optimizer for an "AdamW" config, on a GPU
    assert result["param_device"] == "cuda:0" and result["param_dtype"] == dtype
    assert result["extensions_written"] == []
    # ZeRO 1 to 3 partition Adam's state: each rank holds about 1/processes of it, all of it together
    numel, held = result["numel"], [c["adam_state_numel"] for c in result["checksums"]]
    if stage == 0:
        assert held == [numel] * processes
    else:
        assert all(numel / processes <= n < numel / processes + 16 for n in held), (numel, held)
    if stage == 3:  # outside the forward and backward the ZeRO-3 parameters are released
        assert result["param_numel_outside_forward"] < numel
    assert_trains(result)
    before, after = result["eval"]
    assert after < before, result["eval"]


@pytest.mark.parametrize("processes", [2, 4])
def test_deepspeed_zero_stages_in_fp32_train_as_ddp(run, processes):
    """ZeRO 0 to 3 from an "AdamW" config, no clipping: DDP with torch's AdamW, step by step.

    On 4 GPUs each step takes two micro-batches (gradient accumulation), ZeRO's buckets hold
    300 elements (several reductions and gathers per step, overlapped) and gradients are
    clipped to norm 0.5, which DeepSpeed computes over the partitions."""
    if processes == 2:
        runs = run(DIRECT, "--runs", "ddp,zero0,zero1,zero2,zero3")
        stages = ["zero0", *ZERO]
    else:
        extra = ("--accumulate", "2", "--bucket", "300", "--clip", "0.5")
        runs = run(DIRECT, "--runs", "ddp,zero1,zero2,zero3", *extra, processes=4)
        stages = ZERO
    ddp = runs["ddp"]
    assert ddp["engine"] == "DistributedDataParallel" and ddp["param_device"] == "cuda:0"
    assert_ranks_agree(ddp)
    for name in stages:
        result = runs[name]
        assert_direct_zero(result, processes, int(name[-1]))
        assert_same_training(result, ddp)
        assert_same_training(result, runs[stages[-1]], weights_rel=1e-6)
        assert result["eval"] == pytest.approx(ddp["eval"], **FP32)
        if name != "zero0":  # DeepSpeed computes no norm without ZeRO when it does not clip
            assert result["grad_norms"] == pytest.approx(ddp["grad_norms"], **FP32)
    if processes == 4:
        assert runs["zero1"]["global_steps"] == 6  # 12 micro-batches, 6 optimizer steps
        assert max(ddp["grad_norms"]) > 0.5  # the clipping did clip
    else:  # with DeepSpeed's bucket sizes ZeRO-3 releases every parameter (its persistence threshold is 0 here)
        assert runs["zero3"]["param_numel_outside_forward"] == 0


@pytest.mark.parametrize("processes", [2, 4])
def test_deepspeed_zero_stages_in_bf16_train(run, processes):
    """bf16 ZeRO 0 to 3: the weights in bf16 on the GPU, the stages agree, within bf16's precision
    of the same launch's fp32 DDP run (each launch is read by one test only, so that pytest-xdist's
    workers do not repeat one)."""
    if processes == 2:
        runs = run(DIRECT, "--runs", "ddp,zero0,zero1,zero2,zero3", "--precision", "bf16")
        stages = ["zero0", *ZERO]
    else:
        extra = ("--accumulate", "2", "--bucket", "300", "--clip", "0.5")
        runs = run(DIRECT, "--runs", "ddp,zero1,zero2,zero3", "--precision", "bf16", *extra, processes=4)
        stages = ZERO
    fp32 = runs["ddp"]
    assert fp32["param_dtype"] == "torch.float32"
    optimizers = {"zero0": "FP16_Optimizer", "zero1": "DeepSpeedZeroOptimizer", "zero2": "DeepSpeedZeroOptimizer"}
    for name in stages:
        result = runs[name]
        assert_direct_zero(result, processes, int(name[-1]), dtype="torch.bfloat16")
        assert result["optimizer"] == optimizers.get(name, "DeepSpeedZeroOptimizer_Stage3")
        assert result["losses"] != fp32["losses"]  # it did compute in bf16
        # ZeRO 1-3 keep fp32 master weights; without ZeRO DeepSpeed's bf16 optimizer strays further
        # (the same on CPU ranks, to the bit)
        rel = 0.1 if name == "zero0" else 2e-2
        assert result["losses"] == pytest.approx(fp32["losses"], rel=rel)
        assert result["trained"]["abs"] == pytest.approx(fp32["trained"]["abs"], rel=rel)
    for name in ZERO:  # the partitioned stages agree to bf16's rounding (a bf16 step is 2**-8 relative)
        assert runs[name]["losses"] == pytest.approx(runs["zero3"]["losses"], rel=4e-3)
        assert runs[name]["trained"]["abs"] == pytest.approx(runs["zero3"]["trained"]["abs"], rel=1e-3)


def test_deepspeed_zero_stages_in_fp16_skip_overflowing_steps(run):
    """fp16 with DeepSpeed's dynamic loss scale: 2**16 makes the first two steps' gradients overflow
    float16, so each stage skips them and lowers the scale (found through the inf the gradient
    norm takes, all-reduced over the ranks), then trains; the stages agree. (The same launch
    on CPU ranks gives these losses to the bit.)"""
    runs = run(DIRECT, "--runs", "zero1,zero2,zero3", "--precision", "fp16", "--loss_scale_power", "16")
    for name in ZERO:
        result = runs[name]
        assert result["param_dtype"] == "torch.float16" and result["zero_stage"] == int(name[-1])
        # two skips, one halving: DeepSpeed's hysteresis (2) lets the first overflow keep the scale
        assert result["skipped_steps"] == 2 and result["loss_scale"] == 2.0**15
        assert result["grad_norms"][:2] == [math.inf, math.inf], result["grad_norms"]
        assert all(math.isfinite(norm) and 0.1 < norm < 10 for norm in result["grad_norms"][2:]), result["grad_norms"]
        assert result["grad_norms"] == pytest.approx(runs["zero3"]["grad_norms"], rel=1e-3)
        assert result["losses"] == pytest.approx(runs["zero3"]["losses"], rel=1e-3)
        assert result["trained"]["abs"] == pytest.approx(runs["zero3"]["trained"]["abs"], rel=1e-3)
        assert_trains(result)


# -- Accelerate's DeepSpeedPlugin -----------------------------------------------------------------

ACCELERATE_RUNS = "ddp,zero1:torch,zero2:torch,zero3:torch,zero1:config,zero2:config,zero3:config"


def assert_accelerate_deepspeed(result, processes, stage, dtype):
    assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["model"] == "DeepSpeedEngine"
    assert result["device"] == result["param_device"] == "cuda:0" and result["world_size"] == processes
    assert result["zero_stage"] == stage and result["param_dtype"] == dtype and result["gradient_clipping"] == 0.5
    # torch's AdamW given to `prepare` stays DeepSpeed's basic optimizer; DummyOptim lets DeepSpeed build FusedAdam
    assert result["basic_optimizer"] == ("AdamW" if result["run"].endswith(":torch") else "FusedAdam")
    assert result["optimizer"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
    assert "zero_to_fp32.py" in result["saved"] and "latest" in result["saved"]  # DeepSpeed's checkpoint
    # save_state, a step, load_state: back to the saved weights
    assert result["moved"] != result["trained"] and result["reloaded"] == result["trained"]
    assert result["state_dict"] == result["trained"]  # what get_state_dict gives the main process
    assert_trains(result)


@pytest.mark.parametrize("processes", [2, 4])
def test_accelerate_deepspeed_plugin_in_fp32_trains_as_ddp(run, processes):
    runs = run(ACCELERATE, "--runs", ACCELERATE_RUNS, processes=processes)
    ddp = runs["ddp"]
    assert ddp["distributed_type"] == "DistributedType.MULTI_GPU" and ddp["model"] == "DistributedDataParallel"
    assert ddp["reloaded"] == ddp["trained"] != ddp["moved"]
    assert_ranks_agree(ddp)
    assert max(ddp["grad_norms"]) > 0.5  # steps clipped, by torch for DDP, by DeepSpeed under ZeRO
    for name, result in runs.items():
        if name == "ddp":
            continue
        assert_accelerate_deepspeed(result, processes, int(name[4]), "torch.float32")
        assert_same_training(result, ddp)
        assert result["grad_norms"] == pytest.approx(ddp["grad_norms"], **FP32)
        # DeepSpeed's zero_to_fp32 puts the ranks' partitions back together into the trained weights
        assert result["consolidated"] == result["trained"]


def test_accelerate_deepspeed_plugin_in_bf16(run):
    """DeepSpeed's bf16 (bf16 weights, fp32 master weights) against DDP under Accelerate's bf16 autocast."""
    runs = run(ACCELERATE, "--runs", ACCELERATE_RUNS, "--mixed_precision", "bf16")
    ddp = runs["ddp"]  # DDP under bf16 autocast, fp32 weights
    assert ddp["mixed_precision"] == "bf16" and ddp["param_dtype"] == "torch.float32"
    assert_ranks_agree(ddp)
    for name, result in runs.items():
        if name == "ddp":
            continue
        assert_accelerate_deepspeed(result, 2, int(name[4]), "torch.bfloat16")
        assert result["bf16"] is True and result["mixed_precision"] == "bf16"
        assert result["losses"] != ddp["losses"]
        assert result["losses"] == pytest.approx(ddp["losses"], rel=1e-2)
        assert result["trained"]["abs"] == pytest.approx(ddp["trained"]["abs"], rel=1e-2)
        assert result["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=2e-2)
        # the checkpoint's fp32 master weights, rounded to bf16, are the bf16 weights trained
        assert result["consolidated"]["abs"] == pytest.approx(result["trained"]["abs"], rel=1e-2)
        assert result["losses"] == pytest.approx(runs["zero3:config"]["losses"], rel=4e-3)


# -- the Transformers Trainer ---------------------------------------------------------------------


def assert_trainer_deepspeed(result, stage, dtype):
    assert result["device"] == result["param_device"] == "cuda:0" and result["world_size"] == 2
    assert result["parallel_mode"] == "ParallelMode.DISTRIBUTED" and result["wrapper"] == "DeepSpeedEngine"
    assert result["zero_stage"] == stage and result["basic_optimizer"] == "FusedAdam"
    assert result["param_dtype"] == dtype and result["gradient_clipping"] == 1.0
    # under ZeRO-3 Transformers built the model inside deepspeed.zero.Init, partitioned as it was made
    assert result["zero3_enabled"] is result["built_partitioned"] is (stage == 3)
    assert result["global_step"] == 6 and len(result["losses"]) == 6
    assert result["saved"] == result["trained"]  # save_model wrote the trained weights (ZeRO-3: gathered)
    assert result["saved_extra"] == ([] if stage == 3 else ["lm_head.weight"])
    assert result["eval_loss"] < result["initial"]["eval_loss"]
    assert_trains(result)


def test_the_trainer_with_deepspeed_in_fp32_trains_as_ddp(run):
    runs = run(TRAINER, "--runs", "ddp,zero1,zero2,zero3")
    ddp = runs["ddp"]
    assert ddp["wrapper"] == "DistributedDataParallel" and ddp["param_device"] == "cuda:0"
    assert_ranks_agree(ddp)
    assert ddp["saved"] == ddp["trained"] and ddp["eval_loss"] < ddp["initial"]["eval_loss"]
    for name in ZERO:
        result = runs[name]
        assert_trainer_deepspeed(result, int(name[-1]), "torch.float32")
        # the Trainer's fused AdamW (DDP) and DeepSpeed's FusedAdam: the same steps (no weight decay, see the program)
        assert_same_training(result, ddp)
        assert result["grad_norms"] == pytest.approx(ddp["grad_norms"], **FP32)
        assert result["eval_loss"] == pytest.approx(ddp["eval_loss"], **FP32)
        assert_same_training(result, runs["zero3"], weights_rel=1e-6)


def test_the_trainer_with_deepspeed_in_bf16(run):
    """DeepSpeed's bf16 under the Trainer (`bf16=True`, "bf16": "auto") against DDP under the Trainer's autocast."""
    runs = run(TRAINER, "--runs", "ddp,zero1,zero2,zero3", "--precision", "bf16")
    ddp = runs["ddp"]
    assert ddp["param_dtype"] == "torch.float32" and ddp["bf16"] is True  # autocast
    assert_ranks_agree(ddp)
    assert ddp["eval_loss"] < ddp["initial"]["eval_loss"]
    for name in ZERO:
        result = runs[name]
        assert_trainer_deepspeed(result, int(name[-1]), "torch.bfloat16")
        assert result["bf16"] is True
        assert result["losses"] != ddp["losses"]
        assert result["losses"] == pytest.approx(ddp["losses"], rel=1e-2)
        assert result["eval_loss"] == pytest.approx(ddp["eval_loss"], rel=1e-2)
        assert result["losses"] == pytest.approx(runs["zero3"]["losses"], rel=4e-3)
