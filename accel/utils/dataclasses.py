"""Enums, kwargs handlers and configuration dataclasses of the public API."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import enum
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from accel.utils.environment import str_to_bool

# the FSDP plugin has a module of its own; users import it from here, as from Accelerate's module
from accel.utils.fsdp_plugin import FullyShardedDataParallelPlugin  # noqa: F401


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
