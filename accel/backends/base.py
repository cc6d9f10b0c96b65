"""The backend seam: everything that differs between kinds of hardware.

A `Backend` answers the hardware questions of one kind of device: which device a rank
uses, which `torch.distributed` backend it speaks, how to seed and snapshot its RNG,
how collectives are done, how a model, an optimizer step and a data loader are
wrapped, and which autocast device type and GradScaler apply. The rest of `accel`
asks the active backend and never branches on the kind of hardware itself.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist

from accel.utils.dataclasses import DistributedType
from accel.utils.environment import env_int


class Backend:
    """Base class of a hardware backend; subclasses override the touch points they need."""

    #: registry name of the backend ("cpu", "cuda", "xla", or a simulator's name)
    name: str = "base"
    #: `torch.distributed` backend this hardware speaks ("gloo", "nccl", "xla")
    comm_backend: str = "gloo"
    #: device type given to `torch.autocast` and `torch.amp.GradScaler`
    autocast_device_type: str = "cpu"
    #: distributed type when more than one process runs
    multi_process_type: DistributedType = DistributedType.MULTI_CPU
    #: distributed type of a single process
    single_process_type: DistributedType = DistributedType.NO
    #: higher wins when several backends are available
    priority: int = 0
    #: whether a multi-process run may shard models with FSDP2 (`DistributedType.FSDP`), as on GPUs
    supports_fsdp: bool = False

    @classmethod
    def is_available(cls) -> bool:
        """Whether this hardware can be used in this process."""
        return False

    # -- process placement -------------------------------------------------------------

    def device(self, local_rank: int) -> torch.device:
        """The device that the process with this local rank computes on."""
        return torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        """Make `device` the current device of this process (no-op where meaningless)."""

    def launch_env(self) -> tuple[int, int, int, int]:
        """(rank, world_size, local_rank, local_world_size) as the launcher set them."""
        world_size = env_int("WORLD_SIZE", 1)
        rank = env_int("RANK", 0)
        local_rank = env_int("LOCAL_RANK", rank)
        return rank, world_size, local_rank, env_int("LOCAL_WORLD_SIZE", world_size)

    def distributed_type(self, num_processes: int) -> DistributedType:
        return self.multi_process_type if num_processes > 1 else self.single_process_type

    def init_process_group(
        self,
        backend: str | None = None,
        init_method: str | None = None,
        timeout: datetime.timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        """Initialise the default process group from the launcher's environment."""
        options: dict[str, Any] = {"backend": backend or self.comm_backend}
        if init_method is not None:
            options["init_method"] = init_method
        if timeout is not None:
            options["timeout"] = timeout
        options.update(kwargs)
        dist.init_process_group(**options)

    # -- random number generators ------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        """Seed the device's own generator (the CPU one is seeded by the caller)."""

    def get_rng_state(self) -> torch.Tensor | None:
        """Snapshot of the device generator, or None where the device has none of its own."""
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a snapshot taken by `get_rng_state`."""

    def checkpoint_rng_states(self) -> dict[str, Any]:
        """The device generators' states, under the keys of Accelerate's `random_states_<rank>.pkl`."""
        return {}

    def restore_checkpoint_rng_states(self, states: dict[str, Any]) -> None:
        """Restore what `checkpoint_rng_states` captured (a checkpoint without this device's keys: no-op)."""

    # -- collectives (used by accel.utils.operations) -------------------------------------

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Gather equal-shaped `tensor` of every rank into `output`, concatenated on dim 0."""
        dist.all_gather_single(output, tensor)
        return output

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` in place across ranks; `op` is "sum", "max" or "min"."""
        dist.all_reduce(tensor, op=_REDUCE_OPS[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` on every rank with the one of rank `src`, in place."""
        dist.broadcast(tensor, src=src)
        return tensor

    def object_group(self) -> Any:
        """Process group for pickled-object collectives (None: the default group)."""
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.object_group())
        return out

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> list[Any]:
        """Replace the items of `objects` on every rank by those of rank `src`, in place."""
        dist.broadcast_object_list(objects, src=src, group=self.object_group())
        return objects

    def barrier(self) -> None:
        """Block until every rank reaches this point."""
        dist.barrier()

    # -- training --------------------------------------------------------------------------

    def ddp_device_ids(self, device: torch.device) -> list[int] | None:
        """`device_ids` for `DistributedDataParallel` (None for CPU-resident modules)."""
        return None

    def wrap_model(self, model: torch.nn.Module, device: torch.device, ddp_kwargs: dict) -> torch.nn.Module:
        """Wrap a model for multi-process data-parallel training."""
        from torch.nn.parallel import DistributedDataParallel

        ids = self.ddp_device_ids(device)
        return DistributedDataParallel(model, device_ids=ids, output_device=ids[0] if ids else None, **ddp_kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """Take one optimizer step (XLA reduces gradients here)."""
        return optimizer.step(**kwargs)

    def wrap_dataloader(self, dataloader: Any, device: torch.device) -> Any:
        """Wrap a data loader so that it feeds `device` (XLA uses its own loader)."""
        return dataloader

    def autocast(self, dtype: torch.dtype, enabled: bool = True, **kwargs: Any) -> contextlib.AbstractContextManager:
        """Autocast context for this hardware."""
        return torch.autocast(device_type=self.autocast_device_type, dtype=dtype, enabled=enabled, **kwargs)

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
        """Loss scaler for fp16 training on this hardware."""
        return torch.amp.GradScaler(self.autocast_device_type, **kwargs)

    def mark_step(self) -> None:
        """Cut the lazy graph where the hardware needs it (XLA); no-op elsewhere."""

    def save(self, obj: Any, f: Any) -> None:
        """Write `obj` to `f` (XLA moves tensors to CPU first)."""
        torch.save(obj, f)

    def supports_join(self) -> bool:
        """Whether `DistributedDataParallel.join` can run on this hardware."""
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
