"""CUDA backend: one process per NVIDIA GPU, NCCL collectives.

The hardware touch points (`_cuda_device`, `set_device`, `comm_backend` and the
`torch.cuda` RNG calls) are small methods so that the simulator can swap them and run
the rest of this logic unchanged on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.backends.base import Backend
from accel.utils.dataclasses import DistributedType


class CUDABackend(Backend):
    """NVIDIA GPUs through `torch.cuda`."""

    name = "cuda"
    comm_backend = "nccl"
    autocast_device_type = "cuda"
    multi_process_type = DistributedType.MULTI_GPU
    priority = 10
    supports_fsdp = True

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device(self, local_rank: int) -> torch.device:
        count = self.device_count()
        if count == 0:
            raise RuntimeError("CUDA backend selected but no GPU is visible; check CUDA_VISIBLE_DEVICES.")
        return self._cuda_device(local_rank % count)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def _cuda_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def set_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    def checkpoint_rng_states(self) -> dict[str, Any]:
        return {"torch_cuda_manual_seed": torch.cuda.get_rng_state_all()}

    def restore_checkpoint_rng_states(self, states: dict[str, Any]) -> None:
        saved = states.get("torch_cuda_manual_seed")
        if saved is not None:
            # a checkpoint from a machine with more GPUs: this one restores the devices it has
            torch.cuda.set_rng_state_all(list(saved)[: torch.cuda.device_count()])

    def barrier(self) -> None:
        # NCCL's barrier is an all-reduce on a GPU: name this process's, or torch guesses
        # one (with a warning) and may set up a communicator on the wrong device.
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])

    def ddp_device_ids(self, device: torch.device) -> list[int] | None:
        return [device.index] if device.type == "cuda" else None
