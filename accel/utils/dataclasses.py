"""Enums, kwargs handlers and configuration dataclasses of the public API."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import enum
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from accel.utils.constants import FSDP_AUTO_WRAP_POLICY, FSDP_BACKWARD_PREFETCH, FSDP_SHARDING_STRATEGY


class _StrEnum(str, enum.Enum):
    """A string-valued enum that compares equal to its value (``DistributedType.NO == "NO"``)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class DistributedType(_StrEnum):
    """How the current run is distributed.

    All of Accelerate's members exist, so that comparisons in user code keep working;
    runs happen only as `NO`, `MULTI_CPU`, `MULTI_GPU` or `XLA` (`supported()`), and a
    run that would need another one fails with `require_supported`.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    @classmethod
    def supported(cls) -> tuple[DistributedType, ...]:
        """The kinds of run accel can carry out."""
        return (cls.NO, cls.MULTI_CPU, cls.MULTI_GPU, cls.XLA, cls.FSDP)

    def require_supported(self, reason: str = "") -> DistributedType:
        """Return this member if accel can run it; otherwise raise NotImplementedError saying what to do."""
        if self in self.supported():
            return self
        because = f" ({reason})" if reason else ""
        raise NotImplementedError(
            f"DistributedType.{self.name} is not supported by accel{because}: it runs "
            f"{', '.join(m.value for m in self.supported())} only. Use plain DDP on CPUs/GPUs or XLA, "
            "or run this script with Hugging Face Accelerate itself."
        )


#: environment variables (of Accelerate, or ours) that ask for an engine accel does not have
UNSUPPORTED_ENGINE_ENV = {
    "USE_DEEPSPEED": DistributedType.DEEPSPEED,
    "USE_MEGATRON_LM": DistributedType.MEGATRON_LM,
}


def check_engine_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise if `ACCELERATE_USE_DEEPSPEED`/`_FSDP`/`_MEGATRON_LM` (or `ACCEL_USE_...`) asks for an engine we lack.

    A launcher configured for Accelerate sets these; running such a script as plain DDP
    would silently train something else than asked, so it is an error.
    """
    environ = os.environ if environ is None else environ
    for suffix, kind in UNSUPPORTED_ENGINE_ENV.items():
        for prefix in ("ACCELERATE_", "ACCEL_"):
            value = environ.get(prefix + suffix, "").strip().lower()
            if value in ("1", "true", "yes", "on", "y", "t"):
                kind.require_supported(f"{prefix}{suffix}={environ[prefix + suffix]} asks for it")


class RNGType(_StrEnum):
    """Random number generators that can be synchronised across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class LoggerType(_StrEnum):
    """Experiment trackers that ``Accelerator(log_with=...)`` names (see `accel.tracking`)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class PrecisionType(_StrEnum):
    """Mixed-precision modes accepted by ``Accelerator(mixed_precision=...)``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


def _check_choice(owner: str, field: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise a ValueError naming the field and the allowed values when `value` is not one of them."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}.{field}={value!r} is not supported; use one of {allowed}")


@dataclasses.dataclass
class KwargsHandler:
    """Base of the handlers that customise how `Accelerator` builds torch objects.

    `to_kwargs()` returns only the fields that differ from their defaults, so that
    torch's own defaults apply for everything the user did not set.
    """

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if defaults.get(k, _MISSING) != v}


_MISSING = object()


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of `torch.autocast` used by mixed precision (`enabled`, `cache_enabled`)."""

    enabled: bool = True
    cache_enabled: bool | None = None


class DDPCommunicationHookType(_StrEnum):
    """Gradient communication hooks of `DistributedDataParallel`."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of `DistributedDataParallel`, plus an optional communication hook.

    `comm_hook` compresses gradients on the wire (fp16/bf16) or uses PowerSGD;
    `comm_wrapper` wraps a PowerSGD hook with fp16/bf16 compression;
    `comm_state_option` is passed to the PowerSGD state.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        name = type(self).__name__
        self.comm_hook = _coerce(DDPCommunicationHookType, self.comm_hook, name, "comm_hook")
        self.comm_wrapper = _coerce(DDPCommunicationHookType, self.comm_wrapper, name, "comm_wrapper")
        _check_choice(name, "comm_wrapper", self.comm_wrapper, ["no", "fp16", "bf16"])
        if self.comm_state_option and self.comm_hook not in ("power_sgd", "batched_power_sgd"):
            raise ValueError(f"{name}.comm_state_option is only used with comm_hook='power_sgd' or 'batched_power_sgd'")

    def to_kwargs(self) -> dict[str, Any]:
        """Only the `DistributedDataParallel` constructor arguments that differ from their defaults."""
        hook_fields = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in super().to_kwargs().items() if k not in hook_fields}

    def register_comm_hook(self, model: Any) -> None:
        """Register the chosen communication hook on a `DistributedDataParallel` model."""
        if self.comm_hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hook: Any
        if self.comm_hook in ("fp16", "bf16"):
            hook = default_hooks.fp16_compress_hook if self.comm_hook == "fp16" else default_hooks.bf16_compress_hook
            model.register_comm_hook(state=None, hook=hook)
            return
        state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        hook = powerSGD_hook.powerSGD_hook if self.comm_hook == "power_sgd" else powerSGD_hook.batched_powerSGD_hook
        if self.comm_wrapper == "fp16":
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif self.comm_wrapper == "bf16":
            hook = default_hooks.bf16_compress_wrapper(hook)
        model.register_comm_hook(state=state, hook=hook)


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of `torch.amp.GradScaler` used for fp16 training."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.init_scale <= 0:
            raise ValueError(f"{name}.init_scale must be positive, got {self.init_scale}")
        if self.growth_factor <= 1.0:
            raise ValueError(f"{name}.growth_factor must be greater than 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"{name}.backoff_factor must lie in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"{name}.growth_interval must be a positive integer, got {self.growth_interval}")


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments of `torch.distributed.init_process_group` (`backend` None: the hardware's own)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not isinstance(self.timeout, datetime.timedelta):
            raise ValueError(
                f"InitProcessGroupKwargs.timeout must be a datetime.timedelta, got {type(self.timeout).__name__}"
            )


_PROFILER_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia")


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments of `torch.profiler.profile`, used by `Accelerator.profile()`.

    `activities` names what to record ("cpu", "cuda", ...); `schedule_option` holds the
    `torch.profiler.schedule` arguments (wait, warmup, active, repeat, skip_first);
    `output_trace_dir` makes each finished profile write a Chrome trace there.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        for activity in self.activities or []:
            _check_choice(type(self).__name__, "activities", activity, _PROFILER_ACTIVITIES)

    def build(self) -> Any:
        """A `torch.profiler.profile` configured by these fields."""
        from torch import profiler

        activities = None
        if self.activities is not None:
            activities = [getattr(profiler.ProfilerActivity, a.upper()) for a in self.activities]
        schedule = profiler.schedule(**self.schedule_option) if self.schedule_option is not None else None
        return profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


_FP8_BACKENDS = ("TE", "MSAMP", "AO")


@dataclasses.dataclass
class FP8RecipeKwargs(KwargsHandler):
    """The FP8 recipe: which engine ("TE" TransformerEngine, "MSAMP", "AO" torchao) and its settings."""

    backend: str | None = None
    use_autocast_during_eval: bool = False
    opt_level: str = "O2"
    margin: int = 0
    interval: int = 1
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str = "most_recent"
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.backend is not None:
            self.backend = str(self.backend).upper()
            _check_choice(name, "backend", self.backend, _FP8_BACKENDS)
        self.fp8_format = str(self.fp8_format).upper()
        _check_choice(name, "fp8_format", self.fp8_format, ["HYBRID", "E4M3", "E5M2"])
        _check_choice(name, "opt_level", self.opt_level, ["O1", "O2"])
        _check_choice(name, "amax_compute_algo", self.amax_compute_algo, ["max", "most_recent"])
        if self.margin < 0 or self.interval < 1 or self.amax_history_len < 1:
            raise ValueError(f"{name}: margin must be >= 0, interval and amax_history_len >= 1")


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradients accumulate: over `num_steps` batches, synchronised at each boundary.

    `adjust_scheduler` steps the scheduler as if each batch were a step;
    `sync_with_dataloader` forces a synchronisation at the end of the data loader;
    `sync_each_batch` synchronises on every batch (less memory, more communication).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(
                "GradientAccumulationPlugin.num_steps must be a positive integer (or None for 1), "
                f"got {self.num_steps!r}"
            )


class DynamoBackend(_StrEnum):
    """Backends of `torch.compile` that `TorchDynamoPlugin` names (upper case, as Accelerate spells them)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


_DYNAMO_ENV = "ACCELERATE_DYNAMO_"


@dataclasses.dataclass
class TorchDynamoPlugin(KwargsHandler):
    """Arguments of `torch.compile` (`backend`, `mode`, `fullgraph`, `dynamic`, `options`, `disable`).

    Fields left as None are read from `ACCELERATE_DYNAMO_BACKEND` / `_MODE` /
    `_USE_FULLGRAPH` / `_USE_DYNAMIC` / `_USE_REGIONAL_COMPILATION` (what `accelerate
    launch --dynamo_*` sets), else: backend "no", mode "default", fullgraph False,
    dynamic None (torch decides). `use_regional_compilation` compiles repeated blocks one by
    one; it is not an argument of `torch.compile` and `to_kwargs()` leaves it out.
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        from accel.utils.environment import str_to_bool

        backend = self.backend if self.backend is not None else os.environ.get(_DYNAMO_ENV + "BACKEND", "no")
        self.backend = _coerce(DynamoBackend, str(backend).upper(), "TorchDynamoPlugin", "backend")
        if self.mode is None:
            self.mode = os.environ.get(_DYNAMO_ENV + "MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = str_to_bool(os.environ.get(_DYNAMO_ENV + "USE_FULLGRAPH", "False")) == 1
        if self.use_regional_compilation is None:
            self.use_regional_compilation = (
                str_to_bool(os.environ.get(_DYNAMO_ENV + "USE_REGIONAL_COMPILATION", "False")) == 1
            )
        if self.dynamic is None and _DYNAMO_ENV + "USE_DYNAMIC" in os.environ:
            self.dynamic = str_to_bool(os.environ[_DYNAMO_ENV + "USE_DYNAMIC"]) == 1

    def to_dict(self) -> dict[str, Any]:
        config = copy.deepcopy(self.__dict__)
        config["backend"] = str(config["backend"]).lower()
        return config

    def to_kwargs(self) -> dict[str, Any]:
        # the defaults are those of a plugin built without the ACCELERATE_DYNAMO_* environment
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(_DYNAMO_ENV)}
        try:
            defaults = type(self)().to_dict()
        finally:
            os.environ.update(saved)
        kwargs = {k: v for k, v in self.to_dict().items() if defaults.get(k, _MISSING) != v}
        kwargs.pop("use_regional_compilation", None)
        return kwargs


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` builds data loaders (see `prepare_data_loader`)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    #: load through torchdata's StatefulDataLoader (its state saved by save_state)
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project writes checkpoints and logs, and how checkpoints are named and kept.

    With `automatic_checkpoint_naming`, `save_state()` writes
    `project_dir/checkpoints/checkpoint_<iteration>` and keeps at most `total_limit` of them.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"ProjectConfiguration.total_limit must be None or >= 1, got {self.total_limit}")
        if self.iteration < 0:
            raise ValueError(f"ProjectConfiguration.iteration must be >= 0, got {self.iteration}")

    def set_directories(self, project_dir: str | None = None) -> None:
        """Point the project (and, unless set apart, the logs) at `project_dir`."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


def _coerce(enum_cls: type[_StrEnum], value: Any, owner: str, field: str) -> Any:
    """Turn a string into a member of `enum_cls`, or raise a ValueError naming the allowed values."""
    try:
        return enum_cls(value)
    except ValueError:
        raise ValueError(f"{owner}.{field}={value!r} is not supported; use one of {enum_cls.list()}") from None


_FSDP_ENV = "FSDP_"
_logger = logging.getLogger(__name__)


def _torch_enum(enum_cls: Any, value: Any, names: list[str]) -> Any:
    """`value` as a member of torch's `enum_cls`: given as the member, by one of `names` (any case; the i-th name
    is member number i + 1, as Accelerate numbers them) or by number (an int or a string of digits); None stays
    None."""
    if value is None or isinstance(value, enum_cls):
        return value
    numbers = {member.value: member for member in enum_cls}
    if isinstance(value, str) and value.upper() in names:
        value = names.index(value.upper()) + 1
    number = int(value) if isinstance(value, int) or (isinstance(value, str) and value.isdigit()) else None
    if number in numbers:
        return numbers[number]
    known = [name for i, name in enumerate(names) if i + 1 in numbers]
    raise ValueError(f"{value!r} is not a {enum_cls.__name__}: use one of {known} (or their numbers {sorted(numbers)})")


_FSDP_SHARDING = FSDP_SHARDING_STRATEGY
_FSDP_PREFETCH = FSDP_BACKWARD_PREFETCH
_FSDP_WRAP_POLICIES = FSDP_AUTO_WRAP_POLICY
_FSDP_PRECISIONS = {"fp8": "bfloat16", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _env_bool(name: str, default: str = "False") -> bool:
    from accel.utils.environment import str_to_bool

    return str_to_bool(os.environ.get(name, default)) == 1


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`), with Accelerate's fields.

    Fields left as None are read from the `FSDP_*` environment that `accel launch --use_fsdp
    --fsdp_*` (or `accelerate launch`) sets, with Accelerate's defaults. accel runs
    `fsdp_version=2`; a plugin asking for version 1 (the `FullyShardedDataParallel` wrapper)
    can be built, but `Accelerator` refuses it (see `accel.fsdp`).

    - `reshard_after_forward`: free the gathered parameters after each forward (bool).
    - `auto_wrap_policy`: "transformer_based_wrap" (shard each module whose class is named in
      `transformer_cls_names_to_wrap`, default the model's `_no_split_modules`),
      "size_based_wrap" (each module with more than `min_num_params` parameters), "no_wrap",
      or torch's `transformer_auto_wrap_policy` / `size_based_auto_wrap_policy`.
    - `mixed_precision_policy`: a `torch.distributed.fsdp.MixedPrecisionPolicy`, a dict of its
      fields, or "bf16" / "fp16" / "fp32" (default: from the Accelerator's mixed precision).
    - `cpu_offload`: keep the sharded parameters on the CPU (bool or `CPUOffloadPolicy`).
    - `state_dict_type`: "SHARDED_STATE_DICT" (default for version 2: `save_state` writes a
      distributed checkpoint) or "FULL_STATE_DICT" (one file written by rank 0).
    - `cpu_ram_efficient_loading`: rank 0's weights are broadcast into the sharded model (the
      other ranks may hold empty weights).
    - `activation_checkpointing`: recompute the activations of each wrapped layer in backward.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable[[Any], None] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        env = os.environ
        if self.fsdp_version is None:
            self.fsdp_version = int(env.get(_FSDP_ENV + "VERSION", "1"))
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FullyShardedDataParallelPlugin.fsdp_version must be 1 or 2, got {self.fsdp_version!r}")
        two = self.fsdp_version == 2
        if not two and self.sharding_strategy is None:
            self.sharding_strategy = env.get(_FSDP_ENV + "SHARDING_STRATEGY", "FULL_SHARD")
        if self.reshard_after_forward is None and self.sharding_strategy is None:
            self.reshard_after_forward = env.get(_FSDP_ENV + "RESHARD_AFTER_FORWARD", "true" if two else "FULL_SHARD")
        if not two:
            # FSDP1's fields hold torch's enums, whether given by name, by number or as the enum
            from torch.distributed.fsdp import ShardingStrategy

            self.sharding_strategy = _torch_enum(ShardingStrategy, self.sharding_strategy, _FSDP_SHARDING)
            if isinstance(self.reshard_after_forward, bool):
                raise ValueError(
                    f"reshard_after_forward={self.reshard_after_forward!r} is FSDP2's spelling; with fsdp_version=1 "
                    "give a sharding strategy (a name such as 'FULL_SHARD' or torch's ShardingStrategy)"
                )
            self.reshard_after_forward = _torch_enum(ShardingStrategy, self.reshard_after_forward, _FSDP_SHARDING)
        if two:
            if isinstance(self.reshard_after_forward, str):
                from accel.utils.environment import str_to_bool

                self.reshard_after_forward = str_to_bool(self.reshard_after_forward.lower(), to_bool=True)
            if self.reshard_after_forward is None and self.sharding_strategy is not None:
                # the FSDP1 spelling: FULL_SHARD frees the gathered parameters after forward, the others keep them
                name = str(getattr(self.sharding_strategy, "name", self.sharding_strategy)).upper()
                self.reshard_after_forward = name in ("FULL_SHARD", "1", "HYBRID_SHARD", "4")
            if not isinstance(self.reshard_after_forward, bool):
                raise ValueError(
                    f"reshard_after_forward set to {self.reshard_after_forward!r}: FSDP2 takes a bool (True frees the "
                    "gathered parameters after forward)"
                )
        if self.cpu_offload is None:
            self.cpu_offload = _env_bool(_FSDP_ENV + "OFFLOAD_PARAMS")
        if two and isinstance(self.cpu_offload, bool):
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

            self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        elif isinstance(self.cpu_offload, bool):
            from torch.distributed.fsdp import CPUOffload

            self.cpu_offload = CPUOffload(offload_params=self.cpu_offload)
        if self.backward_prefetch is None:
            self.backward_prefetch = env.get(_FSDP_ENV + "BACKWARD_PREFETCH")
        if isinstance(self.backward_prefetch, str) and self.backward_prefetch.upper() == "NO_PREFETCH":
            self.backward_prefetch = None
        if self.backward_prefetch is not None:
            from torch.distributed.fsdp import BackwardPrefetch

            self.backward_prefetch = _torch_enum(BackwardPrefetch, self.backward_prefetch, _FSDP_PREFETCH)
        if two and self.backward_prefetch is not None:
            # FSDP2 prefetches on its own (Accelerate drops the field too, and warns in these words)
            _logger.warning("backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.")
            self.backward_prefetch = None
        self.set_state_dict_type()
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = env.get(_FSDP_ENV + "AUTO_WRAP_POLICY", "NO_WRAP")
        if isinstance(self.auto_wrap_policy, str):
            policy = self.auto_wrap_policy.upper()
            if policy not in _FSDP_WRAP_POLICIES:
                raise ValueError(
                    f"Invalid auto wrap policy: {self.auto_wrap_policy}. Must be one of {_FSDP_WRAP_POLICIES}"
                )
            from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

            if policy == "TRANSFORMER_BASED_WRAP":
                self.auto_wrap_policy = transformer_auto_wrap_policy
                if self.transformer_cls_names_to_wrap is None and env.get(_FSDP_ENV + "TRANSFORMER_CLS_TO_WRAP"):
                    self.transformer_cls_names_to_wrap = env[_FSDP_ENV + "TRANSFORMER_CLS_TO_WRAP"].split(",")
            elif policy == "SIZE_BASED_WRAP":
                self.auto_wrap_policy = size_based_auto_wrap_policy
                if self.min_num_params is None:
                    self.min_num_params = int(env.get(_FSDP_ENV + "MIN_NUM_PARAMS", 0))
            else:
                self.auto_wrap_policy = None
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
        if self.min_num_params is not None and not isinstance(self.min_num_params, int):
            raise ValueError(f"`min_num_params` must be an integer. Got {self.min_num_params!r}")
        if two:
            # obsolete in FSDP2 (Accelerate drops them too)
            self.use_orig_params = None
            self.sync_module_states = None
            if self.forward_prefetch:
                raise ValueError(
                    "forward_prefetch is not yet implemented in FSDP2, set to None or use `fsdp_version=1`"
                )
            self.forward_prefetch = None
        else:
            if self.use_orig_params is None:
                self.use_orig_params = _env_bool(_FSDP_ENV + "USE_ORIG_PARAMS")
            if self.sync_module_states is None:
                self.sync_module_states = _env_bool(_FSDP_ENV + "SYNC_MODULE_STATES")
            if self.forward_prefetch is None:
                self.forward_prefetch = _env_bool(_FSDP_ENV + "FORWARD_PREFETCH")
        if self.activation_checkpointing is None:
            self.activation_checkpointing = _env_bool(_FSDP_ENV + "ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _env_bool(_FSDP_ENV + "ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("`activation_checkpointing_offload=True` requires `activation_checkpointing=True`.")
        if self.activation_checkpointing_offload and not two:
            raise ValueError("`activation_checkpointing_offload=True` requires `fsdp_version=2`.")
        if self.ignored_modules is None:
            self.ignored_modules = env.get(_FSDP_ENV + "IGNORED_MODULES")
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _env_bool(_FSDP_ENV + "CPU_RAM_EFFICIENT_LOADING")
        else:
            # Transformers reads it when loading weights
            os.environ[_FSDP_ENV + "CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading)
        if not two and self.cpu_ram_efficient_loading:
            self.sync_module_states = True
        if isinstance(self.mixed_precision_policy, str):
            self.set_mixed_precision(self.mixed_precision_policy, override=True)
        elif isinstance(self.mixed_precision_policy, dict):
            self.set_mixed_precision(self.mixed_precision_policy)

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Set `state_dict_type` (a name or torch's `StateDictType`) and the matching configs."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            default = "FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"
            self.state_dict_type = os.environ.get(_FSDP_ENV + "STATE_DICT_TYPE", default)
        if isinstance(self.state_dict_type, str):
            name = self.state_dict_type
            self.state_dict_type = StateDictType(int(name)) if name.isdigit() else StateDictType[name.upper()]
        if self.state_dict_type == StateDictType.FULL_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
        elif self.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)
        if self.fsdp_version == 2 and self.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            raise ValueError(
                "FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` to `SHARDED_STATE_DICT` or "
                "`FULL_STATE_DICT`."
            )

    def set_mixed_precision(self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False) -> None:
        """Set the mixed precision policy from "bf16" / "fp16" / "fp32" / "fp8" or a dtype (kept when one is set,
        unless `override`); a dict policy becomes torch's policy object."""
        import torch

        dtypes = {name: getattr(torch, dtype) for name, dtype in _FSDP_PRECISIONS.items()}
        dtype = mixed_precision
        if isinstance(mixed_precision, str):
            dtype = dtypes.get(mixed_precision)
            if dtype is None:
                raise ValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of {list(dtypes)}")
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

        Policy: Any = MixedPrecisionPolicy if self.fsdp_version == 2 else MixedPrecision
        if override or self.mixed_precision_policy is None:
            fields: dict[str, Any] = {"param_dtype": dtype, "reduce_dtype": dtype}
            if self.fsdp_version == 2:
                fields["output_dtype"] = dtype
            else:
                fields["buffer_dtype"] = torch.float32 if buffer_autocast else dtype
            self.mixed_precision_policy = Policy(**fields)
        elif isinstance(self.mixed_precision_policy, dict):
            self.mixed_precision_policy = Policy(**self.mixed_precision_policy)

    def set_auto_wrap_policy(self, model: Any) -> None:
        """Turn the auto-wrap policy into torch's policy for `model`, as Accelerate does before sharding it.

        Transformer-based: the classes named in `transformer_cls_names_to_wrap` (default: the model's
        `_no_split_modules`; `ValueError` for a name no module of `model` has) are bound to torch's
        `transformer_auto_wrap_policy`. Size-based: `min_num_params` is bound to torch's
        `size_based_auto_wrap_policy`; with `min_num_params=0` nothing is wrapped (the policy becomes None).
        """
        import functools

        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

        from accel.fsdp import layer_classes_to_wrap

        policy = self.auto_wrap_policy
        base = policy.func if isinstance(policy, functools.partial) else policy
        if base is transformer_auto_wrap_policy:
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
            classes = set(layer_classes_to_wrap(self, model))
            self.auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        elif base is size_based_auto_wrap_policy:
            if self.min_num_params:
                self.auto_wrap_policy = functools.partial(
                    size_based_auto_wrap_policy, min_num_params=self.min_num_params
                )
            else:
                self.auto_wrap_policy = None
