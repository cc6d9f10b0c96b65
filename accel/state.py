"""Shared process state: who am I, how many are we, which hardware, which process group.

`PartialState`, `AcceleratorState` and `GradientState` are shared-state classes: every
instance of one class reads and writes the same attributes, set up by the first
instantiation. Between tests, call `reset_state()` to start from scratch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from accel.backends import Backend, select_backend
from accel.utils.dataclasses import DistributedType, PrecisionType, check_engine_environment
from accel.utils.environment import env_flag
from accel.utils.fsdp_plugin import FullyShardedDataParallelPlugin, check_version

DEBUG_ENV = "ACCEL_DEBUG_MODE"
CPU_ENV = "ACCEL_USE_CPU"
MIXED_PRECISION_ENV = "ACCEL_MIXED_PRECISION"


class _Topology:
    """The shared topology attributes, declared once for readers and type checkers.

    `PartialState._setup` sets them; `AcceleratorState` reads them through to `PartialState`.
    """

    hardware: Backend
    process_index: int
    num_processes: int
    local_process_index: int
    num_processes_per_node: int
    device: torch.device
    distributed_type: DistributedType
    debug: bool
    adopted_process_group: bool
    fork_launched: bool


class PartialState(_Topology):
    """Process topology and control, without anything training-specific.

    Reads the variables that `torchrun` (PyTorch's elastic launcher) sets, initialises
    the default process group through the active backend when more than one process
    runs, or adopts a group that is already initialised.

    Args:
        cpu: force the CPU backend even where an accelerator is present.
        debug: check shapes across ranks before collectives (also `ACCEL_DEBUG_MODE=1`).
        **kwargs: passed to `torch.distributed.init_process_group` (`backend`,
            `init_method`, `timeout`, ...), e.g. from `InitProcessGroupKwargs.to_kwargs()`.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, debug: bool | None = None, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self._setup(cpu or env_flag(CPU_ENV), debug, kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling joins the shared state (a state pickled in this process is the same state); in a
        # process without one yet, the pickled attributes become the shared state.
        _join_shared_state(self, state)

    def _setup(self, cpu: bool, debug: bool | None, init_kwargs: dict[str, Any]) -> None:
        check_engine_environment()  # DeepSpeed/FSDP/Megatron asked for: refuse rather than run plain DDP
        hardware = select_backend(cpu=cpu)
        rank, world_size, local_rank, local_world_size = hardware.launch_env()
        adopted = dist.is_available() and dist.is_initialized()
        if adopted:
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif world_size > 1:
            if init_kwargs.get("init_method") is None and not {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set: start the script with "
                    "`accel launch` or `torchrun`, or pass InitProcessGroupKwargs(init_method=...)"
                )
            hardware.init_process_group(**init_kwargs)
        device = hardware.device(local_rank)
        hardware.set_device(device)
        state = self._shared_state
        state.update(
            hardware=hardware,
            process_index=rank,
            num_processes=world_size,
            local_process_index=local_rank,
            num_processes_per_node=local_world_size,
            device=device,
            distributed_type=hardware.distributed_type(world_size),
            debug=env_flag(DEBUG_ENV) if debug is None else bool(debug),
            adopted_process_group=adopted,
            fork_launched=False,
        )

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    @property
    def backend(self) -> str | None:
        """Name of the `torch.distributed` backend in use, None for a single process."""
        return dist.get_backend() if dist.is_available() and dist.is_initialized() else None

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def default_device(self) -> torch.device:
        return self.device

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()

    # -- synchronisation ---------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a no-op on one process)."""
        if self.use_distributed:
            self.hardware.barrier()

    @contextlib.contextmanager
    def _goes_first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on all the others."""
        with self._goes_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each machine's local main process first, then on the others."""
        with self._goes_first(self.is_local_main_process):
            yield

    # -- process decorators ------------------------------------------------------------

    def _only_if(self, function: Callable | None, condition: Callable[[], bool]) -> Callable:
        def decorate(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if condition() else None

            return wrapper

        return decorate if function is None else decorate(function)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run the function on the main process only (returns None elsewhere)."""
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run the function on the local main process of each machine only."""
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run the function on the last process only."""
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: run the function on the process of global index `process_index` only."""
        _check_index("process_index", process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorator: run the function on the process of local index `local_process_index` only."""
        _check_index("local_process_index", local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- splitting work ------------------------------------------------------------------

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give this process its contiguous share of `inputs` (list, tuple, tensor or dict of them).

        With N processes and L items, the first L % N processes get one item more. With
        `apply_padding`, every share is brought to the same length by repeating its last
        item, so that the shares can be gathered; drop the padding afterwards.
        """
        yield split_inputs(inputs, self.num_processes, self.process_index, apply_padding)

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy `group` (default: the default group) if a process group is initialised."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)


def _check_index(name: str, value: int | None) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def split_inputs(inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False) -> Any:
    """The share of `inputs` that process `process_index` of `num_processes` gets (see
    `PartialState.split_between_processes`)."""
    if isinstance(inputs, dict):
        lengths = {key: len(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes needs every value of the dict to have the same length, got {lengths}"
            )
        return {key: split_inputs(value, num_processes, process_index, apply_padding) for key, value in inputs.items()}
    total = len(inputs) if hasattr(inputs, "__len__") else 0
    base, extra = divmod(total, num_processes)
    start = process_index * base + min(process_index, extra)
    if _is_hf_dataset(inputs):  # its rows by index, as Accelerate selects them (padded with the last row)
        rows = list(range(start, start + base + (1 if process_index < extra else 0)))
        if apply_padding and total:
            rows += [total - 1] * (base + (1 if extra else 0) - len(rows))
        return inputs.select(rows)
    if not isinstance(inputs, (list, tuple, torch.Tensor)):
        raise TypeError(
            "split_between_processes takes a list, tuple, tensor, datasets.Dataset or dict of them, "
            f"got {type(inputs).__name__}"
        )
    share = inputs[start : start + base + (1 if process_index < extra else 0)]
    if not apply_padding or total == 0:
        return share
    target = base + (1 if extra else 0)
    missing = target - len(share)
    if missing == 0:
        return share
    if isinstance(inputs, torch.Tensor) and isinstance(share, torch.Tensor):
        last = (share if len(share) else inputs)[-1:]
        return torch.cat([share, last.expand(missing, *last.shape[1:])])
    filler = (share if len(share) else inputs)[-1]
    return type(inputs)(list(share) + [filler] * missing)


def _is_hf_dataset(inputs: Any) -> bool:
    """Whether `inputs` is a Hugging Face `datasets.Dataset` (without importing `datasets` if nobody has)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(inputs, getattr(datasets, "Dataset", ()))


#: AcceleratorState's names answered by the PartialState also after AcceleratorState._reset_state()
_PROCESS_LEVEL = frozenset(
    {
        "use_distributed",
        "fork_launched",
        "is_last_process",
        "is_main_process",
        "is_local_main_process",
        "wait_for_everyone",
        "split_between_processes",
        "main_process_first",
        "local_main_process_first",
        "print",
        "destroy_process_group",
    }
)


class AcceleratorState(_Topology):
    """`PartialState` plus what training needs (mixed precision); its attributes include all
    of `PartialState`'s.

    Args:
        mixed_precision: "no", "fp16", "bf16" or "fp8" (default from `ACCEL_MIXED_PRECISION`).
        cpu: force the CPU backend.
        **kwargs: passed on to `PartialState`.
    """

    _shared_state: dict[str, Any] = {}

    partial: PartialState
    _mixed_precision: str
    initialized: bool
    # Read through to PartialState (see __getattr__), like the topology; declared for type checkers.
    use_distributed: bool
    is_main_process: bool
    is_local_main_process: bool
    is_last_process: bool

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        _from_accelerator: bool = False,
        fsdp_plugin: Any = None,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        partial = PartialState(cpu, **kwargs)
        requested = _check_precision(mixed_precision) if mixed_precision is not None else None
        if not self._shared_state:
            precision = requested or _check_precision(os.environ.get(MIXED_PRECISION_ENV, "no"))
            self._shared_state.update(
                partial=partial,
                _mixed_precision=precision,
                initialized=_from_accelerator,
                fsdp_plugin=None,
            )
            try:
                self._setup_sharding(partial, fsdp_plugin, precision)
            except BaseException:
                self._shared_state.clear()  # refused (FSDP1): no half-made state left behind
                raise
            return
        if _from_accelerator and requested is not None and requested != self._mixed_precision and self.initialized:
            raise ValueError(
                f"AcceleratorState was already initialised with mixed_precision={self._mixed_precision!r} and cannot "
                f"change to {requested!r}; pass mixed_precision to the first Accelerator() or call reset_state()"
            )
        if requested is not None:
            self._mixed_precision = requested
        if fsdp_plugin is not None and fsdp_plugin is not self._shared_state.get("fsdp_plugin"):
            raise ValueError(
                f"AcceleratorState was already initialised with fsdp_plugin={self._shared_state.get('fsdp_plugin')!r} "
                "and cannot take another; pass the plugin to the first Accelerator() or call reset_state() first"
            )
        self.initialized = self.initialized or _from_accelerator

    def _setup_sharding(self, partial: PartialState, fsdp_plugin: Any, precision: str) -> None:
        """Run as `DistributedType.FSDP` when a plugin (or `ACCELERATE_USE_FSDP`) asks for it on hardware that
        shards (GPUs, several processes), as Accelerate does; elsewhere the plugin is kept and not used."""
        if fsdp_plugin is None and (env_flag("ACCELERATE_USE_FSDP") or env_flag("ACCEL_USE_FSDP")):
            fsdp_plugin = FullyShardedDataParallelPlugin()
        if fsdp_plugin is None:
            return
        if precision != "no":
            # as Accelerate: the run's precision becomes the plugin's policy (one it holds already is kept)
            fsdp_plugin.set_mixed_precision(precision)
        if partial.hardware.supports_fsdp and partial.num_processes > 1:
            check_version(fsdp_plugin)
            self._shared_state["distributed_type"] = DistributedType.FSDP
        self._shared_state["fsdp_plugin"] = fsdp_plugin

    @property
    def is_fsdp2(self) -> bool:
        """Whether this run shards with FSDP2 (`DistributedType.FSDP`, plugin version 2)."""
        plugin = self._shared_state.get("fsdp_plugin")
        return self.distributed_type == DistributedType.FSDP and getattr(plugin, "fsdp_version", None) == 2

    def __setstate__(self, state: dict[str, Any]) -> None:
        _join_shared_state(self, state)

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the instance: delegate to PartialState.
        if name.startswith("__"):
            raise AttributeError(name)
        if "partial" not in self._shared_state and name in _PROCESS_LEVEL and PartialState._shared_state:
            # As Accelerate: what concerns the processes only is answered by the PartialState, which outlives
            # AcceleratorState._reset_state() (an Accelerator kept across it still says whether it is the main one).
            return getattr(PartialState(), name)
        if "partial" not in self._shared_state:
            raise AttributeError(
                # Accelerate's words, which its scripts check
                f"`AcceleratorState` object has no attribute `{name}`. This happens if "
                "`AcceleratorState._reset_state()` was called and an `Accelerator` or `PartialState` was not "
                "reinitialized: create an Accelerator() again before using it"
            )
        return getattr(self._shared_state["partial"], name)

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy `group` (default: the default group) if a process group is initialised (also after a reset)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return repr(self.partial) + f"Mixed precision type: {self.mixed_precision}\n"

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def _join_shared_state(obj: Any, state: dict[str, Any]) -> None:
    """`__setstate__` of the shared-state classes: `obj` shares its class's state, filled from `state`
    only when this process has none yet."""
    shared = type(obj)._shared_state
    if not shared:
        shared.update(state)
    obj.__dict__ = shared


def _check_precision(value: str) -> str:
    value = str(value).lower()
    if value not in PrecisionType.list():
        raise ValueError(f"mixed_precision={value!r} is not supported; choose one of {PrecisionType.list()}")
    return value


_NO_PLUGIN: dict[str, Any] = {
    "num_steps": 1,
    "adjust_scheduler": False,
    "sync_with_dataloader": True,
    "sync_each_batch": False,
}


class GradientState:
    """Gradient synchronisation and data-loader progress, shared by the training wrappers.

    `sync_gradients` says whether this step synchronises (the end of an accumulation
    window); `end_of_dataloader` and `remainder` describe the batch being used now of
    the innermost data loader being iterated (`active_dataloader`).
    """

    _shared_state: dict[str, Any] = {}

    sync_gradients: bool
    active_dataloader: Any
    dataloader_references: list[Any]
    plugin_kwargs: dict[str, Any]

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references = [None]
            self.plugin_kwargs = dict(_NO_PLUGIN)
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = {
                f.name: getattr(gradient_accumulation_plugin, f.name)
                for f in dataclasses.fields(gradient_accumulation_plugin)
            }
            if self.plugin_kwargs.get("num_steps") is None:
                self.plugin_kwargs["num_steps"] = 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        _join_shared_state(self, state)

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs["num_steps"]

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs["adjust_scheduler"]

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs["sync_with_dataloader"]

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin_kwargs["sync_each_batch"]

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.in_dataloader and getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        return getattr(self.active_dataloader, "remainder", -1) if self.in_dataloader else -1

    @property
    def distributed_type(self) -> DistributedType | None:
        return PartialState().distributed_type if PartialState._shared_state else None

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()


def is_initialized() -> bool:
    """Whether an `AcceleratorState` exists in this process (Accelerate's module-level check)."""
    return bool(AcceleratorState._shared_state)


def reset_state(destroy_process_group: bool = False) -> None:
    """Forget every shared state (`PartialState`, `AcceleratorState`, `GradientState`).

    The next instantiation sets them up again from the environment. Tests call this
    between cases; pass `destroy_process_group=True` to also tear down the default
    process group.
    """
    if destroy_process_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def active_backend() -> Backend:
    """The hardware backend of this process (sets up `PartialState` if needed)."""
    return PartialState().hardware


__all__ = [
    "PartialState",
    "AcceleratorState",
    "GradientState",
    "DistributedType",
    "reset_state",
    "active_backend",
    "split_inputs",
]
