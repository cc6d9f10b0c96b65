"""Simulated GPUs: `torch.cuda` answers as on a GPU host, and the real CUDA backend runs on them.

Nothing is installed in this (the pytest) process: simulated GPUs exist only in ranks,
which the tests start with `accel.sim.launch(device="cuda")` or `@distributed_test`.
"""

import subprocess
import sys

import pytest
import torch

from accel.sim import launch
from accel.sim.cuda import fake as fake_cuda
from accel.sim.cuda.fake import DEFAULT_CUDA_SEED
from accel.sim.runtime.cleanslate import SEED
from harness import distributed_test

SIZES = [2, 4]


def test_importing_accel_leaves_torch_untouched():
    # A fresh interpreter: importing everything accel has must not install the simulated GPU.
    code = """
import torch
real = (torch.cuda.is_available, torch.Tensor.to, torch.tensor, torch.cuda.manual_seed)
import accel, accel.sim, accel.sim.cuda.fake, accel.sim.devices, accel.sim.core.torch_internals
import accel.sim.cuda.tensors.cuda_tensor, accel.sim.cuda.tensors.factories, accel.sim.cuda.tensors.checkpoint
import accel.sim.cuda.kernels.autocast, accel.sim.cuda.nccl.mixed_group
from accel import Accelerator
now = (torch.cuda.is_available, torch.Tensor.to, torch.tensor, torch.cuda.manual_seed)
assert now == real, now
assert "to" not in torch.Tensor.__dict__ and not torch.cuda.is_available()
assert torch._C._get_privateuse1_backend_name() == "privateuseone"
assert not accel.sim.cuda.fake.is_installed() and not accel.sim.cuda.fake.SimCUDABackend.is_available()
print("untouched")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "untouched", result.stderr[-2000:]


def test_nothing_is_installed_in_the_test_process():
    assert not fake_cuda.is_installed() and DEFAULT_CUDA_SEED == 67280421310721  # torch's CUDA default
    assert not fake_cuda.SimCUDABackend.is_available()
    with pytest.raises(RuntimeError, match="no simulated GPUs in this process"):
        fake_cuda.set_device_calls()


# -- torch.cuda in a simulated GPU rank ------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_torch_cuda_answers_as_on_a_gpu_host(rank, world_size):
    assert torch.cuda.is_available() and torch.cuda.is_initialized()
    assert torch.cuda.device_count() == world_size and torch.cuda.current_device() == rank
    other = (rank + 1) % world_size
    torch.cuda.set_device(other)
    torch.cuda.set_device(torch.device("cuda", rank))
    assert torch.cuda.current_device() == rank and fake_cuda.set_device_calls() == [other, rank]
    with torch.cuda.device(other):
        assert torch.cuda.current_device() == other
    assert torch.cuda.current_device() == rank
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_allocated() == 0
    # the default card (README): an H100
    assert torch.cuda.is_bf16_supported() and torch.cuda.get_device_capability() == (9, 0)
    assert torch.cuda.get_device_name(other) == "NVIDIA H100 80GB HBM3"
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@distributed_test(world_size=SIZES, device="cuda")
def test_rng_functions_are_per_simulated_gpu(rank, world_size):
    other = (rank + 1) % world_size
    assert torch.cuda.initial_seed() == SEED  # every test starts from the harness's seed
    torch.cuda.manual_seed(5)  # the current GPU only
    assert torch.cuda.initial_seed() == 5
    # the other GPU's state, CUDA's Philox (seed, offset): untouched
    assert torch.cuda.get_rng_state(other).view(torch.int64).tolist() == [SEED, 0]
    torch.cuda.manual_seed_all(7)
    states = torch.cuda.get_rng_state_all()
    assert len(states) == world_size and all(s.equal(states[0]) for s in states)
    snapshot = torch.cuda.get_rng_state()
    torch.cuda.seed()
    assert torch.cuda.initial_seed() != 7
    torch.cuda.set_rng_state(snapshot)
    assert torch.cuda.get_rng_state().equal(snapshot) and torch.cuda.initial_seed() == 7
    torch.cuda.seed_all()
    torch.cuda.set_rng_state_all(states)
    assert all(a.equal(b) for a, b in zip(torch.cuda.get_rng_state_all(), states, strict=True))


@distributed_test(world_size=SIZES, device="cuda")
def test_what_cannot_be_simulated_fails_naming_it():
    from accel.sim.cuda.fake import SimulatedDeviceError

    for attempt, what in [
        (torch.cuda.utilization, "utilization"),
        (torch.cuda.temperature, "temperature"),
    ]:
        with pytest.raises(SimulatedDeviceError, match=f"{what}.* is not available on a simulated GPU"):
            attempt()


@distributed_test(world_size=[2], device="cuda")
def test_rank_state_is_reset_between_tests_part_one():
    torch.cuda.set_device(1 - torch.cuda.current_device())
    torch.cuda.manual_seed_all(123)
    torch.autocast("cuda", dtype=torch.float16).__enter__()  # never exited


@distributed_test(world_size=[2], device="cuda")
def test_rank_state_is_reset_between_tests_part_two(rank):
    # runs in the same warm ranks, after part one
    assert torch.cuda.current_device() == rank and torch.cuda.initial_seed() == SEED
    assert fake_cuda.set_device_calls() == []
    x = torch.ones(2, 2, device="cuda")
    assert (x @ x).dtype == torch.float32


# -- the backend -----------------------------------------------------------------------------------


def cuda_probe():
    """Runs in every rank: what the user's code and accel see on simulated GPUs."""
    import os

    import torch.distributed as dist

    from accel.backends import select_backend
    from accel.state import PartialState

    state = PartialState()
    hw = state.hardware
    seen = {
        "type": str(state.distributed_type),
        "backend_name": hw.name,
        "comm": state.backend,
        "device": str(state.device),
        "set_device_calls": fake_cuda.set_device_calls(),
        "ddp_ids": hw.ddp_device_ids(state.device),
    }
    hw.manual_seed(1234 + state.process_index)
    seen["rng_equal"] = hw.get_rng_state().equal(torch.cuda.get_rng_state())
    seen["initial_seed"] = torch.cuda.initial_seed()
    del os.environ["ACCEL_BACKEND"]  # chosen by availability, or by the name "cuda": still simulated
    seen["selected"] = type(select_backend()).__name__
    os.environ["ACCEL_BACKEND"] = "cuda"
    seen["selected_by_name"] = type(select_backend()).__name__
    dist.barrier()
    return seen


@pytest.mark.parametrize("world", SIZES)
def test_the_real_cuda_backend_runs_on_simulated_gpus(world):
    for rank, seen in enumerate(launch(cuda_probe, world_size=world, device="cuda")):
        assert seen["type"] == "MULTI_GPU" and seen["backend_name"] == "sim_cuda"
        assert seen["device"] == f"cuda:{rank}" and seen["ddp_ids"] == [rank]
        assert seen["set_device_calls"] == [rank]
        assert seen["initial_seed"] == 1234 + rank and seen["rng_equal"]
        assert seen["selected"] == seen["selected_by_name"] == "SimCUDABackend"
