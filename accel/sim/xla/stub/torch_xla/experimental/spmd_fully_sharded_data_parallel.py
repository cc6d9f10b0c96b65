"""FSDPv2 (`SpmdFullyShardedDataParallel`) of the simulator: refused by name (it is built on SPMD)."""

from __future__ import annotations

from typing import Any


class SpmdFullyShardedDataParallel:
    """Refused: FSDPv2 shards with SPMD, which the simulator does not simulate."""

    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "torch_xla.experimental.spmd_fully_sharded_data_parallel.SpmdFullyShardedDataParallel (FSDPv2) "
            "(accel simulator): FSDPv2 shards with SPMD, which is not simulated (a simulated TPU rank is one "
            "process driving one device); train data-parallel with xm.optimizer_step or DDP on the 'xla' "
            "process group, or shard with FSDP2 on simulated GPUs (--simulate cuda)"
        )
