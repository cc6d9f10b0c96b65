"""`torch_xla.distributed.fsdp` (FSDPv1 for XLA) of the simulator: refused by name."""

from __future__ import annotations

from typing import Any


class XlaFullyShardedDataParallel:
    """Refused: torch_xla's FSDP (v1) is not simulated."""

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "torch_xla.distributed.fsdp.XlaFullyShardedDataParallel (accel simulator): torch_xla's FSDP is not "
            "simulated; train data-parallel with xm.optimizer_step or DDP on the 'xla' process group, or shard "
            "with FSDP2 on simulated GPUs (--simulate cuda)"
        )


def consolidate_sharded_model_checkpoints(*args: Any, **kwargs: Any) -> None:
    """Refused with FSDP."""
    raise NotImplementedError(
        "torch_xla.distributed.fsdp.consolidate_sharded_model_checkpoints (accel simulator): torch_xla's FSDP "
        "is not simulated"
    )
