"""XLA backend: TPU cores through `torch_xla`.

Imports `torch_xla` only when used, exactly as a TPU host would, so the simulator's
stand-in `torch_xla` package runs this same code on CPU.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
import torch.distributed as dist

from accel.backends.base import Backend
from accel.utils.dataclasses import DistributedType


def _xm():
    import torch_xla.core.xla_model as xm

    return xm


class XLABackend(Backend):
    """TPU (or any XLA device); models are not DDP-wrapped, gradients are reduced in `optimizer_step`."""

    name = "xla"
    comm_backend = "xla"
    autocast_device_type = "xla"
    multi_process_type = DistributedType.XLA
    single_process_type = DistributedType.XLA
    priority = 20

    #: (default group, Gloo group for objects): one per process group, shared by every
    #: backend instance, so that resetting accel's state does not leak Gloo groups
    _object_group: tuple[Any, Any] | None = None

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("torch_xla") is not None

    def device(self, local_rank: int) -> torch.device:
        # torch_xla 2.7+ spells it torch_xla.device() (xm.xla_device() warns that it is deprecated)
        import torch_xla

        device = getattr(torch_xla, "device", None)
        return device() if callable(device) else _xm().xla_device()

    def launch_env(self) -> tuple[int, int, int, int]:
        if "WORLD_SIZE" in os.environ:
            return super().launch_env()
        # Started by torch_xla's own spawner: the runtime knows the topology.
        import torch_xla.runtime as xr

        world_size = xr.world_size()
        return xr.global_ordinal(), world_size, xr.local_ordinal(), xr.local_process_count()

    def init_process_group(self, backend=None, init_method=None, timeout=None, **kwargs: Any) -> None:
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" process group)

        super().init_process_group(backend or "xla", init_method or "xla://", timeout, **kwargs)

    def manual_seed(self, seed: int) -> None:
        _xm().set_rng_state(seed)

    def get_rng_state(self) -> torch.Tensor:
        # XLA's seed is an unsigned 64-bit integer: held in an int64 tensor bit for bit
        seed = int(_xm().get_rng_state())
        return torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64)

    def set_rng_state(self, state: torch.Tensor) -> None:
        _xm().set_rng_state(int(state.item()) & ((1 << 64) - 1))

    def checkpoint_rng_states(self) -> dict[str, Any]:
        return {"xm_seed": _xm().get_rng_state()}

    def restore_checkpoint_rng_states(self, states: dict[str, Any]) -> None:
        if states.get("xm_seed") is not None:
            _xm().set_rng_state(int(states["xm_seed"]))

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        output.copy_(_xm().all_gather(tensor, dim=0))
        return output

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        xm = _xm()
        reduce_type = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}[op]
        xm.all_reduce(reduce_type, [tensor])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        _xm().collective_broadcast([tensor], root_ordinal=src)
        return tensor

    def object_group(self) -> Any:
        # The xla process group carries device tensors only; pickled objects go over Gloo.
        default = dist.distributed_c10d._get_default_group()
        cached = XLABackend._object_group
        # Reuse while the default group is the same and the Gloo group was not destroyed.
        if cached is None or cached[0] is not default or cached[1] not in dist.distributed_c10d._world.pg_map:
            XLABackend._object_group = cached = (default, dist.new_group(backend="gloo"))
        return cached[1]

    def barrier(self) -> None:
        _xm().rendezvous("accel.barrier")

    def wrap_model(self, model: torch.nn.Module, device: torch.device, ddp_kwargs: dict) -> torch.nn.Module:
        return model

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        return _xm().optimizer_step(optimizer, optimizer_args=kwargs)

    def wrap_dataloader(self, dataloader: Any, device: torch.device) -> Any:
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        return MpDeviceLoader(dataloader, device)

    def mark_step(self) -> None:
        import torch_xla

        sync = getattr(torch_xla, "sync", None)  # torch_xla 2.7+; xm.mark_step() warns there
        if callable(sync):
            sync()
        else:
            _xm().mark_step()

    def save(self, obj: Any, f: Any) -> None:
        _xm().save(obj, f)

    def supports_join(self) -> bool:
        # Models are not DDP-wrapped on XLA: uneven inputs are joined by accel itself.
        return False
