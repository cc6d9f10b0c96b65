"""What the runtime asks of a simulated GPU rank (the protocol: `accel.sim.devices`)."""

from __future__ import annotations

from accel.backends import register_backend
from accel.sim.cuda import fake as fake_cuda
from accel.sim.cuda.nccl import mixed_group as cuda_group
from accel.sim.cuda.nccl import process_group as nccl_group
from accel.sim.cuda.nccl.process_group import to_torch as to_torch
from accel.sim.cuda.nccl.process_group import to_user as to_user

#: the accel backend `ACCEL_BACKEND` names in these ranks
BACKEND = fake_cuda.SimCUDABackend.name
#: `init_process_group()` without a backend: the accelerator's own
DEFAULT_BACKEND = "nccl"
#: `init_process_group("nccl")` gets the simulated NCCL group here
HAS_NCCL = True
#: backends the simulator uses under names of its own -> the request each answers exactly
EQUIVALENTS = {cuda_group.BACKEND_NAME: "cpu:gloo,cuda:nccl"}


def prepare(local_rank: int | None = None, device_count: int | None = None) -> None:
    """`device_count` simulated GPUs (default LOCAL_WORLD_SIZE), the real CUDA backend on them, their "nccl" group.

    `local_rank`: the current GPU (default LOCAL_RANK); a process on a simulated node starts on 0.
    """
    fake_cuda.install(local_rank, device_count)
    register_backend(fake_cuda.SimCUDABackend, replace=True)
    # Here torch.cuda says a GPU is present, so whatever asks the registry for "cuda"
    # (by name or by availability) must get the simulated backend, never NCCL.
    register_backend(fake_cuda.SimCUDABackend, "cuda", replace=True)
    nccl_group.install()


def reset() -> None:
    fake_cuda.reset()


def as_fresh_process() -> None:
    """A newly started process is on `cuda:0` and has not initialised CUDA (`accel.sim.devices`)."""
    if fake_cuda.is_installed():
        fake_cuda.reset(local_rank=0, fresh=True)
