"""`Accelerator`: the one object a training script talks to.

It is a facade. Process topology and control come from `AcceleratorState`; every
hardware question goes to the active backend (`state.hardware`); the wrappers live in
their own modules (`accel.optimizer`, `accel.scheduler`, `accel.data_loader`), and so do
checkpoints (`accel.checkpointing`), uneven inputs (`accel.joining`), model unwrapping
(`accel.utils.modeling`), atomic saves and memory release (`accel.utils`).

The per-step methods (`backward`, `accumulate`, the optimizer wrapper) do no collective
and no copy beyond what DistributedDataParallel itself does, so a training step costs
what a hand-written DDP loop costs.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import torch
from torch.utils.hooks import RemovableHandle

from accel.optimizer import AcceleratedOptimizer
from accel.scheduler import AcceleratedScheduler
from accel.state import AcceleratorState, GradientState
from accel.tracking import GeneralTracker
from accel.utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
)
from accel.utils.modeling import extract_model_from_parallel, install_autocast_forward, is_compiled_module

_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_HANDLER_ATTRS = {
    AutocastKwargs: "autocast_handler",
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    ProfileKwargs: "profile_handler",
    FP8RecipeKwargs: "fp8_recipe_handler",
}
_UNSET: Any = object()


_T1 = TypeVar("_T1")
_T2 = TypeVar("_T2")
_T3 = TypeVar("_T3")
_T4 = TypeVar("_T4")
_T5 = TypeVar("_T5")


#: Accelerate's engine arguments accel does not run -> what to do instead
_ENGINES = {
    "deepspeed_plugin": "DeepSpeed is an engine accel does not run; use Accelerate with DeepSpeed, or fsdp_plugin",
    "deepspeed_plugins": "DeepSpeed is an engine accel does not run; use Accelerate with DeepSpeed, or fsdp_plugin",
    "megatron_lm_plugin": "Megatron-LM is an engine accel does not run; use Accelerate with Megatron-LM",
    "torch_tp_plugin": "tensor parallelism through Accelerator is not offered; apply torch's parallelize_module",
    "parallelism_config": "ParallelismConfig (TP/CP/HSDP meshes) is not offered; use fsdp_plugin or a DeviceMesh",
    "dynamo_backend": "torch.compile through Accelerator is not offered; call torch.compile on the model yourself",
    "dynamo_plugin": "torch.compile through Accelerator is not offered; call torch.compile on the model yourself",
}


def _refuse_engines(**given: Any) -> None:
    for name, value in given.items():
        if value is not None and not (name.startswith("dynamo") and str(value).lower() in ("no", "none")):
            raise NotImplementedError(f"Accelerator({name}=...): {_ENGINES[name]}.")


class Accelerator:
    """Prepare models, optimizers, schedulers and data loaders for the current hardware.

    Args:
        device_placement: move models and batches to the process's device.
        split_batches: split each batch of the data loaders across processes instead of
            giving each process its own batches (also in `dataloader_config`).
        mixed_precision: "no", "fp16", "bf16" or "fp8" (default: `ACCEL_MIXED_PRECISION`).
        gradient_accumulation_steps: number of batches whose gradients are accumulated
            before an optimizer step (or pass `gradient_accumulation_plugin`).
        cpu: force the CPU even where an accelerator is present.
        dataloader_config: how data loaders are sharded (`DataLoaderConfiguration`).
        rng_types: RNGs to synchronise at the start of each epoch of prepared data
            loaders (default `["generator"]`).
        log_with: experiment trackers: "tensorboard", "all", `LoggerType` members, tracker
            names registered with `accel.tracking.register_tracker_class`, or
            `GeneralTracker` instances (see `init_trackers`).
        project_dir / project_config: where checkpoints go and how they are named.
        gradient_accumulation_plugin: full control of accumulation (`GradientAccumulationPlugin`).
        step_scheduler_with_optimizer: prepared schedulers follow the optimizer's real steps.
        kwargs_handlers: `AutocastKwargs`, `DistributedDataParallelKwargs`,
            `GradScalerKwargs`, `InitProcessGroupKwargs`, `ProfileKwargs`, `FP8RecipeKwargs`.
        dispatch_batches / even_batches / use_seedable_sampler: shortcuts for the fields
            of `dataloader_config`.
        fsdp_plugin: a `FullyShardedDataParallelPlugin(fsdp_version=2, ...)`: on several GPUs,
            `prepare` shards the model with FSDP2 (`DistributedType.FSDP`, see `accel.fsdp`).
    """

    # set from kwargs_handlers by _set_handlers (None: that handler's defaults)
    autocast_handler: AutocastKwargs | None
    ddp_handler: DistributedDataParallelKwargs | None
    scaler_handler: GradScalerKwargs | None
    init_handler: InitProcessGroupKwargs | None
    profile_handler: ProfileKwargs | None
    fp8_recipe_handler: FP8RecipeKwargs | None

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = _UNSET,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        dispatch_batches: bool | None = _UNSET,
        even_batches: bool = _UNSET,
        use_seedable_sampler: bool = _UNSET,
        fsdp_plugin: Any = None,
        deepspeed_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        torch_tp_plugin: Any = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
    ) -> None:
        _refuse_engines(
            deepspeed_plugin=deepspeed_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            torch_tp_plugin=torch_tp_plugin,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugins=deepspeed_plugins,
            parallelism_config=parallelism_config,
        )
        self._set_handlers(kwargs_handlers)
        self.dataloader_config = _merge_dataloader_config(
            dataloader_config,
            split_batches=split_batches,
            dispatch_batches=dispatch_batches,
            even_batches=even_batches,
            use_seedable_sampler=use_seedable_sampler,
        )
        self._setup_project(project_dir, project_config, log_with)
        self._setup_state(mixed_precision, cpu, fsdp_plugin)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]

        self.gradient_state = GradientState(
            gradient_accumulation_plugin=_accumulation_plugin(gradient_accumulation_plugin, gradient_accumulation_steps)
        )
        self._setup_mixed_precision()
        self._start_bookkeeping()

    def _setup_project(
        self, project_dir: str | os.PathLike | None, project_config: ProjectConfiguration | None, log_with: Any
    ) -> None:
        """Where checkpoints and logs go, and the trackers `log_with` names (started by `init_trackers`)."""
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(os.fspath(project_dir))
        from accel.tracking import filter_trackers

        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers: list[GeneralTracker] = []

    def _setup_state(self, mixed_precision: str | None, cpu: bool, fsdp_plugin: Any) -> None:
        """The shared process state (with the `InitProcessGroupKwargs` handler's settings), its hardware, and
        how models are sharded."""
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        self.state = AcceleratorState(
            mixed_precision=mixed_precision, cpu=cpu, _from_accelerator=True, fsdp_plugin=fsdp_plugin, **init_kwargs
        )
        self._hardware = self.state.hardware
        from accel.fsdp import strategy_for

        # FSDP2 when the state runs DistributedType.FSDP (accel.fsdp); None: replicated data parallelism
        self._sharding = strategy_for(self.state)

    def _start_bookkeeping(self) -> None:
        """Nothing prepared, registered or stepped yet: the counters, lists and hook registries the methods fill."""
        self.step = 0  # batches since the last gradient synchronisation (see accumulate)
        self.flag_tensor: torch.Tensor | None = None
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[Any] = []
        self._custom_objects: list[Any] = []
        self._save_model_state_pre_hook: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict[int, Callable[..., None]] = OrderedDict()

    def _set_handlers(self, kwargs_handlers: Sequence[KwargsHandler] | None) -> None:
        for attr in _HANDLER_ATTRS.values():
            setattr(self, attr, None)
        for handler in kwargs_handlers or []:
            found = next((name for cls, name in _HANDLER_ATTRS.items() if isinstance(handler, cls)), None)
            if found is None:
                raise ValueError(
                    f"kwargs_handlers got {handler!r}; the handlers Accelerator uses are "
                    f"{sorted(cls.__name__ for cls in _HANDLER_ATTRS)}"
                )
            if getattr(self, found) is not None:
                raise ValueError(f"kwargs_handlers got more than one {type(handler).__name__}; pass one")
            setattr(self, found, handler)

    def _setup_mixed_precision(self) -> None:
        precision = self.state.mixed_precision
        self._autocast_dtype = _AUTOCAST_DTYPES.get(precision)
        autocast_kwargs = self.autocast_handler.to_kwargs() if self.autocast_handler is not None else {}
        self._autocast_enabled = autocast_kwargs.pop("enabled", True)
        self._autocast_kwargs = autocast_kwargs
        self.fp8_engine = None
        if precision == "fp8":
            from accel.utils.fp8 import find_fp8_engine

            recipe = self.fp8_recipe_handler
            self.fp8_engine = find_fp8_engine(recipe.backend if recipe is not None else None)
        self.scaler = None
        if precision == "fp16":
            scaler_kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            self.scaler = self._hardware.grad_scaler(**scaler_kwargs)

    # -- state, forwarded ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.state.device

    @property
    def distributed_type(self) -> Any:
        """How this run is distributed (NO, MULTI_CPU, MULTI_GPU, XLA)."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        """Number of processes training together."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """Global index of this process."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """Index of this process on its machine."""
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        """True on one process only."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on one process per machine."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """True on the process of highest index."""
        return self.state.is_last_process

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (`DistributedType.FSDP` with `fsdp_version=2`)."""
        return bool(self.state.is_fsdp2)

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process trains."""
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        """The mixed precision in use: "no", "fp16", "bf16" or "fp8"."""
        return self.state.mixed_precision

    @property
    def split_batches(self) -> bool:
        """Whether prepared loaders split each batch across processes."""
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """Whether prepared loaders load on the main process and dispatch (None: by dataset kind)."""
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        """Whether prepared loaders even out the last batches across processes (settable)."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """Whether prepared loaders shuffle with a seedable sampler."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared loaders load through torchdata's StatefulDataLoader (saved by `save_state`)."""
        return self.dataloader_config.use_stateful_dataloader

    @property
    def non_blocking(self) -> bool:
        """Whether batches are copied to the device asynchronously."""
        return self.dataloader_config.non_blocking

    @property
    def project_dir(self) -> str | None:
        """Where checkpoints are written with automatic naming."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Where logs go (defaults to the project directory)."""
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """Number of the next automatically named checkpoint."""
        return self.project_configuration.iteration

    @property
    def sync_gradients(self) -> bool:
        """Whether this step synchronises gradients (the end of an accumulation window)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Batches accumulated per optimizer step (settable)."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {value!r}")
        self.gradient_state.plugin_kwargs["num_steps"] = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow) by any prepared optimizer."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -- process control, forwarded to the state -------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` once per machine (on the local main process)."""
        self.state.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (no-op on one process)."""
        self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """Run the block on the main process first, then on the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """Run the block on each machine's local main process first, then on the others."""
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> contextlib.AbstractContextManager:
        """Give this process its share of `inputs` (see `PartialState.split_between_processes`)."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run on the main process only."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run on each machine's local main process only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: run on the process of global index `process_index` only."""
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorator: run on the process of local index `local_process_index` only."""
        return self.state.on_local_process(function, local_process_index=local_process_index)

    # -- prepare -------------------------------------------------------------------------------

    # `prepare` gives back what it was given, in order, so that `model, opt = prepare(model, opt)`
    # keeps each variable's type for readers and type checkers (the wrappers behave as the
    # originals: DDP forwards calls, the optimizer and scheduler wrappers delegate).
    @overload
    def prepare(self, a: _T1, /, *, device_placement: Sequence[bool | None] | None = None) -> _T1: ...
    @overload
    def prepare(
        self, a: _T1, b: _T2, /, *, device_placement: Sequence[bool | None] | None = None
    ) -> tuple[_T1, _T2]: ...
    @overload
    def prepare(
        self, a: _T1, b: _T2, c: _T3, /, *, device_placement: Sequence[bool | None] | None = None
    ) -> tuple[_T1, _T2, _T3]: ...
    @overload
    def prepare(
        self, a: _T1, b: _T2, c: _T3, d: _T4, /, *, device_placement: Sequence[bool | None] | None = None
    ) -> tuple[_T1, _T2, _T3, _T4]: ...
    @overload
    def prepare(
        self, a: _T1, b: _T2, c: _T3, d: _T4, e: _T5, /, *, device_placement: Sequence[bool | None] | None = None
    ) -> tuple[_T1, _T2, _T3, _T4, _T5]: ...
    @overload
    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any: ...
    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and data loaders; return them in the order given.

        Anything else is returned unchanged. Schedulers are prepared after the optimizers
        they drive, whatever the order of the arguments. `device_placement` optionally
        gives, per argument, whether to move it to the device.
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects to prepare")
        if self._sharding is not None:
            # FSDP2: the models are sharded (and the optimizers pointed at the shards) together
            args = tuple(self._sharding.shard(self, args))
        result = [
            self._prepare_one(obj, placement, schedulers=False)
            for obj, placement in zip(args, device_placement, strict=True)
        ]
        result = [self._prepare_one(obj, None, schedulers=True) for obj in result]
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, placement: bool | None, schedulers: bool) -> Any:
        if getattr(obj, "_is_accel_prepared", False):
            self._register_prepared(obj)
            return obj
        if schedulers:
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                return self.prepare_scheduler(obj)
            return obj
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=placement)
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        return obj

    def _register_prepared(self, obj: Any) -> None:
        # As Accelerate: an object prepared before is not wrapped again, and is registered (for
        # save_state) only if this accelerator does not hold it already (e.g. after free_memory).
        if isinstance(obj, AcceleratedOptimizer):
            registry: list[Any] = self._optimizers
        elif isinstance(obj, AcceleratedScheduler):
            registry = self._schedulers
        elif isinstance(obj, torch.nn.Module):
            registry = self._models
        else:
            registry = self._dataloaders
        if not any(known is obj for known in registry):
            registry.append(obj)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place `model` on the device, apply mixed precision and wrap it for data parallelism.

        The wrapping is the backend's (DistributedDataParallel on CPU/GPU with the
        `DistributedDataParallelKwargs` and its communication hook; unchanged on XLA). A
        `torch.compile`d model keeps its compiled wrapper around the wrapped module.
        `evaluation_mode=True` skips the data-parallel wrapper. A model prepared before
        is returned as it is.
        """
        if getattr(model, "_is_accel_prepared", False):
            self._register_prepared(model)
            return model
        if self._sharding is not None and not evaluation_mode:
            # FSDP2: mixed precision is the plugin's policy, and the sharded model is its own wrapper
            sharded = self._sharding.shard_model(self, model)
            _mark_prepared(sharded)
            self._models.append(sharded)
            return sharded
        if device_placement is None:
            device_placement = self.device_placement
        # torch.compile's wrapper: typed Any, its module attribute is not in torch's stubs
        compiled: Any = model if is_compiled_module(model) else None
        inner: torch.nn.Module = compiled._orig_mod if compiled is not None else model
        if device_placement:
            inner.to(self.device)
        if self._autocast_dtype is not None:
            install_autocast_forward(inner, self._autocast_context)
        if self.fp8_engine is not None:
            from accel.utils.fp8 import convert_model_to_fp8

            convert_model_to_fp8(inner, self.fp8_engine, self.fp8_recipe_handler)
        already_wrapped = extract_model_from_parallel(inner) is not inner  # the user wrapped it in DDP
        if (
            not (evaluation_mode or already_wrapped)
            and self.use_distributed
            and any(p.requires_grad for p in inner.parameters())
        ):
            ddp_kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
            wrapped = self._hardware.wrap_model(inner, self.device, ddp_kwargs)
            if wrapped is not inner and self.ddp_handler is not None and hasattr(wrapped, "register_comm_hook"):
                self.ddp_handler.register_comm_hook(wrapped)
            inner = wrapped
        if compiled is not None:
            compiled._orig_mod = inner
            # Rebuild the compiled forward around the new inner module.
            compiled._initialize()
            result = compiled
        else:
            result = inner
        _mark_prepared(result)
        self._models.append(result)
        return result

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap `optimizer` in an `AcceleratedOptimizer` (accumulation-aware, fp16 scaler)."""
        if isinstance(optimizer, AcceleratedOptimizer):
            self._register_prepared(optimizer)
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        wrapped = AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.scaler)
        _mark_prepared(wrapped)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap `scheduler` so it follows the real steps of the optimizer it drives."""
        if isinstance(scheduler, AcceleratedScheduler):
            self._register_prepared(scheduler)
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        optimizers = [opt for opt in self._optimizers if opt is target or opt.optimizer is target] or self._optimizers
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        _mark_prepared(wrapped)
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self, data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Callable | None = None
    ) -> Any:
        """Shard `data_loader` across processes (see `accel.data_loader.prepare_data_loader`)."""
        from accel.data_loader import prepare_data_loader

        if getattr(data_loader, "_is_accel_prepared", False):
            self._register_prepared(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=config.split_batches,
            put_on_device=device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=config.use_seedable_sampler,
            non_blocking=config.non_blocking,
            data_seed=config.data_seed,
            use_stateful_dataloader=config.use_stateful_dataloader,
        )
        _mark_prepared(prepared)
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader that skips the first `num_batches` batches of `dataloader` (resuming mid-epoch)."""
        from accel.data_loader import skip_first_batches

        return skip_first_batches(dataloader, num_batches=num_batches)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's module inside the wrappers added by `prepare` (DDP), and inside `torch.compile`'s
        wrapper with `keep_torch_compile=False` (kept by default, as in Accelerate)."""
        return extract_model_from_parallel(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The state dict of `model` without DDP's key prefix (`unwrap_model`: a compiled model keeps its own).

        With FSDP2, the full weights gathered on rank 0's CPU (an empty dict on the other ranks).
        """
        if self._sharding is not None:
            return self._sharding.full_state_dict(model)
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    # -- the training step -------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, divided by the accumulation steps and scaled for fp16."""
        steps = self.gradient_state.num_steps
        if steps != 1:
            loss = loss / steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def _do_sync(self) -> None:
        gradient_state = self.gradient_state
        if gradient_state.sync_with_dataloader and gradient_state.end_of_dataloader:
            self.step = 0
            gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            gradient_state._set_sync_gradients(self.step % gradient_state.num_steps == 0)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip the gradient synchronisation of `model` in this block (accumulating locally)."""
        if self._sharding is not None:
            with self._sharding.no_sync(model):
                yield
            return
        context = getattr(model, "no_sync", None) if self.use_distributed else None
        if context is None:
            yield
            return
        with context():
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Synchronise gradients in the next `backward` even inside a `no_sync` block (DDP models).

        For a model whose gradients were accumulated under `no_sync`: the backward run in
        this block reduces everything accumulated so far. No-op on one process or for a
        model that is not `DistributedDataParallel`.
        """
        reducer = getattr(model, "reducer", None)
        if not self.use_distributed or reducer is None:
            yield
            return
        ddp: Any = model  # DistributedDataParallel's flags are plain attributes, not in nn.Module's typing
        saved = (ddp.require_backward_grad_sync, ddp.require_forward_param_sync)
        ddp.require_backward_grad_sync = True
        ddp.require_forward_param_sync = True
        # what DDP's forward does when it will synchronise: arm the reducer for this backward
        reducer.prepare_for_backward([])
        try:
            yield
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = saved

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One batch of gradient accumulation.

        Counts the batch and sets `sync_gradients`: True at the end of each window of
        `gradient_accumulation_steps` batches and at the end of the data loader (with
        `sync_with_dataloader`). Inside a window, `models` skip their gradient
        synchronisation (unless `sync_each_batch`), and the prepared optimizers do not
        step or zero.
        """
        self._do_sync()
        if self.gradient_state.sync_gradients or self.gradient_state.sync_each_batch or not self.use_distributed:
            yield
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self.no_sync(model))
            yield

    def _autocast_context(self) -> contextlib.AbstractContextManager:
        assert self._autocast_dtype is not None  # only installed when a mixed precision is chosen
        return self._hardware.autocast(self._autocast_dtype, enabled=self._autocast_enabled, **self._autocast_kwargs)

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block in the mixed precision chosen (no-op with "no"); `autocast_handler` overrides."""
        if self._autocast_dtype is None:
            yield
            return
        if autocast_handler is None:
            context = self._autocast_context()
        else:
            kwargs = autocast_handler.to_kwargs()
            enabled = kwargs.pop("enabled", True)
            context = self._hardware.autocast(self._autocast_dtype, enabled=enabled, **kwargs)
        with context:
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Make gradients final before inspecting them: averaged where the backend averages late,
        divided by the fp16 loss scale. Only at a synchronisation step (inside a window the
        gradients are still being accumulated)."""
        if not self.gradient_state.sync_gradients:
            return
        optimizers = (
            self._optimizers
            if optimizer is None
            else optimizer
            if isinstance(optimizer, (list, tuple))
            else [optimizer]
        )
        for opt in optimizers:
            if isinstance(opt, AcceleratedOptimizer):
                opt.unscale_gradients()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` on the final (unscaled) gradients; returns the total norm
        (over every shard with FSDP2)."""
        self.unscale_gradients()
        if self._sharding is not None:
            return self._sharding.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """`torch.nn.utils.clip_grad_value_` on the final (unscaled) gradients."""
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- collectives ----------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate `tensor` (or a nested structure of tensors) of every process on dim 0."""
        from accel.utils.operations import gather

        return gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the samples the data loader duplicated to even out the last batch."""
        from accel.utils.metrics import gather_for_metrics

        return gather_for_metrics(input_data, use_gather_object=use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce `tensor` across processes ("sum" or "mean"), times `scale`."""
        from accel.utils.operations import reduce

        return reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors to the largest size across processes along `dim`, so they can be gathered."""
        from accel.utils.operations import pad_across_processes

        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that `check_trigger` will see on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger` since the last check (a collective; resets the flag)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = self.flag_tensor.clone()
        if self.use_distributed:
            self._hardware.all_reduce(flag, "sum")
        if int(flag.item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Let processes with fewer batches finish instead of hanging the others.

        Where models are DistributedDataParallel (the backend `supports_join()`), this is
        PyTorch's `Join` over `joinables`; elsewhere (XLA) accel joins at the optimizer
        step (see `accel.joining`). `even_batches` temporarily overrides that setting of
        the prepared data loaders, so that they really yield uneven batches inside.
        """
        if not self.use_distributed:
            yield  # one process: nothing to join, nothing uneven (as in Accelerate)
            return
        from accel.joining import join_ddp_models, join_optimizer_steps, override_even_batches

        if self._hardware.supports_join():
            join = join_ddp_models(joinables)
        else:
            join = join_optimizer_steps(self._optimizers, self._hardware)
        with override_even_batches(self._dataloaders, even_batches), join:
            yield

    # -- saving ------------------------------------------------------------------------------------

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """`torch.save` for distributed runs: written once by the main process (once per machine with
        `ProjectConfiguration(save_on_each_node=True)`), atomically, tensors moved to the CPU first.

        `safe_serialization=True` writes a safetensors file (a flat dict of tensors).
        """
        from accel.utils.saving import save

        save(
            obj,
            f,
            save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the weights of `model` (wrapped or not) as Hugging Face libraries lay them out.

        `model.safetensors` (or `pytorch_model.bin` with `safe_serialization=False`); past
        `max_shard_size` (bytes, or a string such as "5MB"), shards
        `model-00001-of-0000N.safetensors` and an index `model.safetensors.index.json`.
        Tied weights are written once. The main process writes; every process may call it.
        """
        from accel.utils.saving import write_model_weights

        if os.path.isfile(save_directory):
            raise ValueError(f"save_model needs a directory, but {os.fspath(save_directory)!r} is a file")
        if any(p.device.type == "meta" for p in model.parameters()):
            raise RuntimeError("save_model: some parameters are on the meta device (not materialised); load them first")
        if self._sharding is not None:
            weights = self._sharding.full_state_dict(model)  # gathered on rank 0, which writes
        else:
            # bare names, also for a torch.compile'd model: what from_pretrained & co. expect
            weights = self.unwrap_model(model, keep_torch_compile=False).state_dict()
        write_model_weights(
            weights,
            os.fspath(save_directory),
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            writes=self._writes_shared_files(),
        )

    def _writes_shared_files(self) -> bool:
        if self.project_configuration.save_on_each_node:
            return self.is_local_main_process
        return self.is_main_process

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` in `save_state`, before anything is written.

        `models` are the prepared models, `weights` their state dicts: a hook may save
        extra files, or remove entries of `weights` to save those models its own way.
        Returns a handle whose `remove()` unregisters the hook.
        """
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` in `load_state`, before anything is loaded.

        A hook may read extra files, or remove entries of `models` that it loads itself.
        Returns a handle whose `remove()` unregisters the hook.
        """
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Have `save_state` / `load_state` include `objects` (each needs `state_dict` and `load_state_dict`)."""
        invalid = [
            obj
            for obj in objects
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
        ]
        if invalid:
            from accel.utils.other import get_pretty_name

            # Accelerate's words ("Item at index i" counts the invalid objects), which its tests check
            listing = "".join(f"\n\t- Item at index {i}, `{get_pretty_name(obj)}`" for i, obj in enumerate(invalid))
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. The following "
                f"inputs are invalid:{listing}"
            )
        self._custom_objects.extend(objects)

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save everything needed to resume training exactly: returns the checkpoint folder.

        Models (safetensors, or pickled with `safe_serialization=False`), optimizers,
        schedulers, the fp16 scaler, registered objects, every process's RNG states and
        data-loader positions, in Accelerate's layout (see `accel.checkpointing`). With
        `ProjectConfiguration(automatic_checkpoint_naming=True)` the folder is
        `project_dir/checkpoints/checkpoint_<n>`, and only the newest `total_limit` are kept.
        `save_model_func_kwargs` serve engines we do not run (DeepSpeed); none is accepted.
        """
        from accel import checkpointing

        if save_model_func_kwargs:
            raise TypeError(
                f"save_state got {sorted(save_model_func_kwargs)}: extra model-saving arguments are for DeepSpeed's "
                "save_checkpoint, which accel does not run"
            )
        output_dir = self._checkpoint_dir(output_dir)
        self._create_checkpoint_dir(output_dir)
        self._hardware.mark_step()
        models, weights, optimizers = self._models_to_save(output_dir)
        # the hooks may remove weights they save their own way
        for hook in self._save_model_state_pre_hook.values():
            hook(models, weights, output_dir)
        config = self.project_configuration
        checkpointing.save_checkpoint(
            output_dir,
            model_states=weights,
            optimizers=optimizers,
            schedulers=self._schedulers,
            dataloaders=self._dataloaders,
            custom_objects=self._custom_objects,
            scaler=self.scaler,
            rng_state=checkpointing.capture_rng_state(self._hardware, self.step),
            process_index=self.process_index,
            save_on_each_node=config.save_on_each_node,
            safe_serialization=safe_serialization,
        )
        config.iteration += 1
        self.wait_for_everyone()
        return output_dir

    def _checkpoint_dir(self, output_dir: str | os.PathLike | None) -> str:
        """The folder `save_state` writes: the next `checkpoint_<n>` with automatic naming (which must not exist
        yet), else `output_dir`."""
        from accel import checkpointing

        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if config.project_dir is None:
                raise ValueError("automatic_checkpoint_naming needs a project_dir (Accelerator(project_dir=...))")
            output_dir = checkpointing.automatic_checkpoint_dir(config.project_dir, config.iteration)
            if os.path.exists(output_dir):
                raise ValueError(
                    f"checkpoint folder {output_dir} already exists; set ProjectConfiguration(iteration=...) past it "
                    "or load_state() it first"
                )
        elif output_dir is None:
            raise ValueError("save_state() needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        return os.fspath(output_dir)

    def _create_checkpoint_dir(self, output_dir: str) -> None:
        """Create `output_dir` on every machine, after the oldest numbered checkpoints past `total_limit` are gone."""
        from accel import checkpointing

        config = self.project_configuration
        # Everyone has checked the folder before the main process creates it.
        self.wait_for_everyone()
        if self._writes_shared_files():
            if config.automatic_checkpoint_naming and config.project_dir is not None:
                checkpointing.prune_checkpoints(config.project_dir, config.total_limit)
            os.makedirs(output_dir, exist_ok=True)
        self.wait_for_everyone()
        os.makedirs(output_dir, exist_ok=True)  # a machine without the shared filesystem

    def _models_to_save(
        self, output_dir: str
    ) -> tuple[list[torch.nn.Module], list[dict[str, Any]], list[AcceleratedOptimizer]]:
        """The user's models, the weights and the optimizers `save_checkpoint` writes for them.

        The weights are bare state dicts (no `module.` prefix), as Accelerate keeps and saves them.
        Under FSDP2 the strategy writes the models and optimizers itself, right away, and none are left for it.
        """
        models = [self.unwrap_model(m) for m in self._models]
        if self._sharding is not None:
            # FSDP2: models and optimizers in Accelerate's FSDP layout; the hooks see no weights (as there)
            self._sharding.save_models(self, output_dir, self._models, self._optimizers)
            return models, [], []
        return models, [m.state_dict() for m in models], self._optimizers

    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> str:
        """Restore what `save_state` (ours or Accelerate's) saved into the prepared objects.

        Returns the folder read. Without `input_dir`, automatic naming loads the newest
        `checkpoint_<n>` and makes the next save number `n + 1`. `load_model_func_kwargs`
        go to the models' `load_state_dict` (`strict=False` loads what matches);
        `map_location` is accepted for compatibility (everything is read onto the CPU and
        placed by the object it loads into). `load_kwargs` (arguments of `torch.load`) are
        not supported.
        """
        from accel import checkpointing

        if load_kwargs:
            raise TypeError(f"load_state(load_kwargs={load_kwargs!r}): accel reads checkpoints with fixed options")
        load_model_func_kwargs.pop("map_location", None)
        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming or config.project_dir is None:
                raise ValueError("load_state() needs input_dir, or automatic checkpoint naming with a project_dir")
            found = checkpointing.numbered_checkpoints(config.project_dir)
            if not found:
                raise FileNotFoundError(
                    f"no checkpoint_<n> folder under {os.path.join(config.project_dir, 'checkpoints')}"
                )
            number, input_dir = found[-1]
            config.iteration = number + 1
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise FileNotFoundError(f"no checkpoint folder at {input_dir!r}")
        models = [self.unwrap_model(m) for m in self._models]
        for hook in self._load_model_state_pre_hook.values():
            hook(models, input_dir)
        # the bare modules: saved names with or without wrapper prefixes match theirs
        bare = [self.unwrap_model(m, keep_torch_compile=False) for m in models]
        optimizers: list[AcceleratedOptimizer] = self._optimizers
        if self._sharding is not None:
            self._sharding.load_models(self, input_dir, self._models, self._optimizers)
            bare, optimizers = [], []
        states = checkpointing.load_checkpoint(
            input_dir,
            models=bare,
            optimizers=optimizers,
            schedulers=self._schedulers,
            dataloaders=self._dataloaders,
            custom_objects=self._custom_objects,
            scaler=self.scaler,
            hardware=self._hardware,
            process_index=self.process_index,
            **load_model_func_kwargs,
        )
        if "step" in states:
            self.step = states["step"]
        return input_dir

    # -- the rest -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with `torch.profiler` configured by `ProfileKwargs`; yields the profiler.

        With `output_trace_dir`, each process writes a Chrome trace `profile_<rank>.json` there.
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object, collect garbage and release cached device memory.

        Returns `[None] * len(objects)` so that callers can drop their own references:
        `model, optimizer = accelerator.free_memory(model, optimizer)`.
        """
        from accel.utils.memory import free_memory

        self._forget_prepared()
        return free_memory(*objects, hardware=self._hardware)

    def _forget_prepared(self) -> None:
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._custom_objects.clear()
        self.step = 0

    clear = free_memory

    def release_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object and release memory (`accel.utils.release_memory`).

        `model, optimizer = accelerator.release_memory(model, optimizer)`.
        """
        from accel.utils.memory import release_memory

        self._forget_prepared()
        return release_memory(*objects)

    # -- experiment trackers ----------------------------------------------------------------------

    def init_trackers(
        self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Start a run named `project_name` in every tracker of `log_with` (on the main process).

        `config` is recorded as the run's hyperparameters; `init_kwargs` maps a tracker's
        name to keyword arguments for its constructor (`{"tensorboard": {"flush_secs": 30}}`).
        """
        if not self.is_main_process:
            return
        from accel.tracking import start_trackers

        self.trackers.extend(start_trackers(self.log_with, project_name, self.logging_dir, config, init_kwargs or {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (its underlying run object with `unwrap=True`).

        On processes that track nothing (all but the main one) it is a tracker that does
        nothing, so that calls on it need no `if is_main_process`.
        """
        if not self.trackers:
            return GeneralTracker(_blank=True)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(
            f"no tracker named {name!r} was started; started: {[t.name for t in self.trackers]} "
            "(Accelerator(log_with=...) then init_trackers())"
        )

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Record `values` at `step` in every started tracker (on the main process).

        `log_kwargs` maps a tracker's name to extra arguments of its `log`.
        """
        if not self.is_main_process:
            return
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish every tracker, wait for every process, then tear down the process group accel created.

        A process group adopted from the user (or a launcher that made it) is left to its
        owner.
        """
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_everyone()
        if not getattr(self.state, "adopted_process_group", False):
            self.state.destroy_process_group()

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r}{self.gradient_state!r})"


def _mark_prepared(obj: Any) -> None:
    # Objects without a __dict__ (slots) cannot be marked; preparing them twice is then the caller's choice.
    if hasattr(obj, "__dict__"):
        obj._is_accel_prepared = True


def _accumulation_plugin(plugin: GradientAccumulationPlugin | None, steps: int) -> GradientAccumulationPlugin:
    if plugin is not None:
        if steps != 1:
            raise ValueError(
                "pass either gradient_accumulation_steps or gradient_accumulation_plugin (with num_steps), not both"
            )
        return plugin
    # `accel launch --gradient_accumulation_steps` sets it for the script, as Accelerate's launcher does.
    steps = int(os.environ.get("ACCEL_GRADIENT_ACCUMULATION_STEPS", steps))
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {steps!r}")
    return GradientAccumulationPlugin(num_steps=steps)


def _merge_dataloader_config(config: DataLoaderConfiguration | None, **shortcuts: Any) -> DataLoaderConfiguration:
    config = config if config is not None else DataLoaderConfiguration()
    for name, value in shortcuts.items():
        if value is _UNSET:
            continue
        default = getattr(DataLoaderConfiguration, name, None)
        current = getattr(config, name)
        if current != default and current != value:
            raise ValueError(
                f"{name}={value!r} conflicts with dataloader_config.{name}={current!r}; set it in one place"
            )
        setattr(config, name, value)
    return config
