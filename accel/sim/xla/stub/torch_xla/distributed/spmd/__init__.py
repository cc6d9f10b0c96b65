"""`torch_xla.distributed.spmd` of the simulator: refused by name.

SPMD runs one process that drives every device of the host as one virtual device and
partitions the graph by sharding annotations; a simulated TPU rank is one process with one
device, in torch_xla's multi-process mode. Each public name exists (so imports work, as on a
TPU host) and raises `NotImplementedError` naming itself when used.
"""

from __future__ import annotations

from typing import Any, NoReturn

_HOW = (
    "SPMD is not simulated (a simulated TPU rank is one process driving one device, as in torch_xla's "
    "multi-process mode); train data-parallel with xm.optimizer_step or DDP on the 'xla' process group, or "
    "shard with FSDP2 on simulated GPUs (--simulate cuda)"
)


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(f"torch_xla.distributed.spmd.{name} (accel simulator): {_HOW}")


class _Refused:
    _name = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse(self._name)


class Mesh(_Refused):
    """Refused: SPMD device mesh."""

    _name = "Mesh"


class HybridMesh(_Refused):
    """Refused: SPMD hybrid device mesh."""

    _name = "HybridMesh"


class ShardingSpec(_Refused):
    """Refused: SPMD sharding spec."""

    _name = "ShardingSpec"


class XLAShardedTensor(_Refused):
    """Refused: SPMD sharded tensor."""

    _name = "XLAShardedTensor"


def mark_sharding(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused: annotate a tensor's sharding over a mesh."""
    _refuse("mark_sharding")


def mark_sharding_with_gradients(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("mark_sharding_with_gradients")


def clear_sharding(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("clear_sharding")


def get_1d_mesh(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("get_1d_mesh")


def set_global_mesh(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("set_global_mesh")


def get_global_mesh(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("get_global_mesh")


def xla_distribute_tensor(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("xla_distribute_tensor")


def xla_distribute_module(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("xla_distribute_module")


def shard_as(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("shard_as")


def enable_manual_sharding(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("enable_manual_sharding")


def disable_manual_sharding(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused."""
    _refuse("disable_manual_sharding")
