"""Simulated GPUs answer as a real one: tests/programs/gpu_probe.py, run on a simulated H200, against
the record of the same script on a real H200 (tests/data/gpu_probe_h200_real.json, torch 2.11, one GPU,
torchrun). Memory is compared to the byte: the caching allocator's rounding, segments and cuBLAS
workspaces; errors by type and words; autocast's dtypes; losses to float rounding (CUDA's kernels
sum in another order)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROBE = HERE / "programs" / "gpu_probe.py"
REAL = json.loads((HERE / "data" / "gpu_probe_h200_real.json").read_text())


#: the cuBLAS workspace settings the real H200 was also probed under -> the record of that run
SETTINGS = {
    "ws16": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
    "unified1": {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"},
    "ws16_unified0": {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"},
}


def probe_simulated_h200(folder: Path, env: dict[str, str]) -> dict:
    out = folder / "sim.json"
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--gpu", "H200"]
    result = subprocess.run(
        [*command, "--num_processes", "1", str(PROBE), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    return probe_simulated_h200(tmp_path_factory.mktemp("probe"), {})


@pytest.mark.parametrize(
    "key", ["name", "capability", "total_memory", "multi_processor_count", "bf16_supported", "accelerator"]
)
def test_the_card_answers_as_the_real_one(simulated, key):
    assert simulated[key] == REAL[key]


def test_memory_of_allocations_and_frees_is_the_real_allocators(simulated):
    assert simulated["memory_sequence"] == REAL["memory_sequence"]


@pytest.mark.parametrize("bug", sorted(REAL["errors"]))
def test_gpu_bugs_fail_with_the_real_gpus_error(simulated, bug):
    assert simulated["errors"][bug] == REAL["errors"][bug]


def test_autocast_dtypes_are_cudas(simulated):
    assert simulated["autocast_bf16"] == REAL["autocast_bf16"]


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_training_peaks_are_the_real_ones(simulated, mode):
    real, sim = REAL["training"][mode], simulated["training"][mode]
    assert sim["peak_allocated"] == real["peak_allocated"]
    assert sim["peak_reserved"] == real["peak_reserved"]
    tolerance = 1e-5 if mode == "fp32" else 1e-4
    assert all(math.isclose(a, b, rel_tol=tolerance) for a, b in zip(sim["losses"], real["losses"], strict=True))


def test_fsdp2_peak_and_losses_are_the_real_ones(simulated):
    real, sim = REAL["fsdp2"], simulated["fsdp2"]
    assert sim["peak_allocated"] == real["peak_allocated"]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(sim["losses"], real["losses"], strict=True))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_training_peaks_under_other_cublas_workspace_settings_are_the_real_ones(tmp_path, setting):
    real = json.loads((HERE / "data" / f"gpu_probe_h200_real_{setting}.json").read_text())
    sim = probe_simulated_h200(tmp_path, SETTINGS[setting])
    for mode in ("fp32", "bf16"):
        assert sim["training"][mode]["peak_allocated"] == real["training"][mode]["peak_allocated"], mode
        assert sim["training"][mode]["peak_reserved"] == real["training"][mode]["peak_reserved"], mode


def test_cublas_workspace_sizes_follow_torchs_rules():
    from accel.sim.cuda import blas as cuda_blas

    assert cuda_blas.cublas_size((9, 0), {}) == 32 * 2**20
    assert cuda_blas.cublas_size((8, 0), {}) == 8 * 2**20 + 128 * 2**10
    assert cuda_blas.cublas_size((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cuda_blas.cublas_size((8, 9), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 2**10
    assert cuda_blas.cublas_size((8, 9), {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}) == 8 * 2**20 + 128 * 2**10
    big, small = 32 * 2**20, 128 * 2**10
    assert cuda_blas.cublaslt_size(big, {}) == 2**20
    assert cuda_blas.cublaslt_size(big, {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * 2**20
    assert cuda_blas.cublaslt_size(small, {}) == small  # no larger than the cuBLAS workspace
    assert cuda_blas.cublaslt_size(small, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 2**20
    assert cuda_blas.cublaslt_size(big, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
