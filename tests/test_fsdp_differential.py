"""FSDP2 through accel against Accelerate itself: the same script (tests/programs/fsdp_train.py), on the
same 2 simulated GPUs, gives the same fp32 losses and final weights; each library resumes from the
other's sharded checkpoint; bf16 runs. Accelerate is a test-only reference."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# whole launches of Accelerate / the Trainer on simulated GPUs: CI's second step (make test-frameworks)
pytestmark = pytest.mark.frameworks

PROGRAM = Path(__file__).resolve().parent / "programs" / "fsdp_train.py"


def launch(lib, out, *extra, processes=2, flags=()):
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", *flags]
    command += ["--num_processes", str(processes), str(PROGRAM), "--lib", lib, "--out", str(out), *map(str, extra)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    lines = [line for line in output.splitlines() if "RESULT " in line]
    assert len(lines) == 1, output[-4000:]
    return json.loads(lines[0].split("RESULT ", 1)[1]), torch.load(os.path.join(out, "weights.pt"))


def assert_same_weights(ours, theirs, tolerance=1e-6):
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name], rtol=tolerance, atol=tolerance), name


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp2_equals_accelerate_and_checkpoints_cross_over(tmp_path, kind):
    theirs, their_weights = launch("accelerate", tmp_path / "accelerate", "--state_dict_type", kind)
    ours, our_weights = launch("accel", tmp_path / "accel", "--state_dict_type", kind)
    assert theirs["distributed_type"].endswith("FSDP") and ours["distributed_type"].endswith("FSDP")
    assert ours["param_type"] == theirs["param_type"] == "DTensor"
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=1e-7)
    assert_same_weights(our_weights, their_weights)
    # each resumes from the other's checkpoint (written half-way) and ends where the other ended
    _, resumed_by_us = launch(
        "accel",
        tmp_path / "accel_from_accelerate",
        "--state_dict_type",
        kind,
        "--resume_from",
        tmp_path / "accelerate" / "checkpoint",
    )
    assert_same_weights(resumed_by_us, their_weights)
    _, resumed_by_them = launch(
        "accelerate",
        tmp_path / "accelerate_from_accel",
        "--state_dict_type",
        kind,
        "--resume_from",
        tmp_path / "accel" / "checkpoint",
    )
    assert_same_weights(resumed_by_them, our_weights)


def test_fsdp2_bf16_runs_as_accelerate(tmp_path):
    theirs, _ = launch("accelerate", tmp_path / "accelerate", "--mixed_precision", "bf16")
    ours, _ = launch("accel", tmp_path / "accel", "--mixed_precision", "bf16")
    assert all(torch.isfinite(torch.tensor(ours["losses"])))
    # bf16 rounding: close to Accelerate's, not equal bit for bit only if the two compute differently
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-2, abs=1e-3)


def test_fsdp2_on_4_simulated_gpus_equals_accelerate(tmp_path):
    theirs, their_weights = launch("accelerate", tmp_path / "accelerate", processes=4)
    ours, our_weights = launch("accel", tmp_path / "accel", processes=4)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=1e-7)
    assert_same_weights(our_weights, their_weights)


def test_fsdp2_from_the_launch_flags(tmp_path):
    flags = [
        "--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
    ]  # fmt: skip
    planned, planned_weights = launch("accel", tmp_path / "plugin")
    launched, launched_weights = launch("accel", tmp_path / "flags", "--plugin_from_launcher", flags=flags)
    assert launched["distributed_type"].endswith("FSDP")
    assert launched["losses"] == pytest.approx(planned["losses"], rel=1e-6, abs=1e-7)
    assert_same_weights(launched_weights, planned_weights)


def test_fsdp2_on_a_transformers_gpt2_equals_accelerate(tmp_path):
    # the model's own _no_split_modules (GPT2Block), tied input/output embeddings, the final norm
    pytest.importorskip("transformers")
    theirs, their_weights = launch("accelerate", tmp_path / "accelerate", "--model", "gpt2")
    ours, our_weights = launch("accel", tmp_path / "accel", "--model", "gpt2")
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=1e-7)
    assert_same_weights(our_weights, their_weights)
