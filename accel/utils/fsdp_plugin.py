"""The FSDP plugin: how a run shards its model with FSDP, as Accelerate's `FullyShardedDataParallelPlugin` says it.

Its fields come from the user or, left as None, from the `FSDP_*` environment that the
launchers set. Below `accel.fsdp` (which carries the sharding out) and `accel.state` (which
refuses FSDP1 at set-up) so that both can read the plugin; importing this module imports
nothing of `torch.distributed.fsdp` until a plugin is built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from accel.utils.constants import FSDP_AUTO_WRAP_POLICY, FSDP_BACKWARD_PREFETCH, FSDP_SHARDING_STRATEGY
from accel.utils.environment import str_to_bool

_FSDP_ENV = "FSDP_"
# the plugin's warnings keep the logger name they had in accel.utils.dataclasses (Accelerate's module)
_logger = logging.getLogger("accel.utils.dataclasses")

FSDP1_REFUSED = (
    "FullyShardedDataParallelPlugin(fsdp_version=1) asks for FSDP1 (the FullyShardedDataParallel wrapper), which accel "
    "does not run: PyTorch deprecates it in favour of FSDP2 (fully_shard). Pass fsdp_version=2 (or launch with "
    "--fsdp_version 2 / FSDP_VERSION=2); the other fields keep their meaning."
)


def check_version(plugin: Any) -> None:
    """Raise, naming the reason, unless `plugin` asks for FSDP2."""
    if plugin.fsdp_version != 2:
        raise NotImplementedError(FSDP1_REFUSED)


def _class_named(model: nn.Module, name: str) -> type | None:
    for module in model.modules():
        if type(module).__name__ == name:
            return type(module)
    return None


def layer_classes_to_wrap(plugin: Any, model: nn.Module) -> list[type]:
    """The classes of `model`'s modules named in the plugin's `transformer_cls_names_to_wrap` (default: the
    model's `_no_split_modules`); `ValueError` for a name that no module has."""
    names = plugin.transformer_cls_names_to_wrap
    if names is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
    classes = []
    for name in names:
        found = _class_named(model, name)
        if found is None:
            raise ValueError(f"Could not find the transformer layer class {name} in the model.")
        classes.append(found)
    return classes


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
        if self.fsdp_version is None:
            self.fsdp_version = int(os.environ.get(_FSDP_ENV + "VERSION", "1"))
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FullyShardedDataParallelPlugin.fsdp_version must be 1 or 2, got {self.fsdp_version!r}")
        two = self.fsdp_version == 2
        self._set_sharding(two)
        self._set_cpu_offload(two)
        self._set_backward_prefetch(two)
        self.set_state_dict_type()
        self._set_wrapping()
        self._set_version_specific_flags(two)
        self._set_activation_checkpointing(two)
        self._set_loading(two)
        if isinstance(self.mixed_precision_policy, str):
            self.set_mixed_precision(self.mixed_precision_policy, override=True)
        elif isinstance(self.mixed_precision_policy, dict):
            self.set_mixed_precision(self.mixed_precision_policy)

    def _set_sharding(self, two: bool) -> None:
        """`sharding_strategy` and `reshard_after_forward`: defaults from the environment, then each version's
        spelling (FSDP1: torch's `ShardingStrategy`; FSDP2: a bool)."""
        if not two and self.sharding_strategy is None:
            self.sharding_strategy = os.environ.get(_FSDP_ENV + "SHARDING_STRATEGY", "FULL_SHARD")
        if self.reshard_after_forward is None and self.sharding_strategy is None:
            default = "true" if two else "FULL_SHARD"
            self.reshard_after_forward = os.environ.get(_FSDP_ENV + "RESHARD_AFTER_FORWARD", default)
        if two:
            self._reshard_as_bool()
        else:
            self._sharding_as_torch_enums()

    def _sharding_as_torch_enums(self) -> None:
        # FSDP1's fields hold torch's enums, whether given by name, by number or as the enum
        from torch.distributed.fsdp import ShardingStrategy

        self.sharding_strategy = _torch_enum(ShardingStrategy, self.sharding_strategy, _FSDP_SHARDING)
        if isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward={self.reshard_after_forward!r} is FSDP2's spelling; with fsdp_version=1 "
                "give a sharding strategy (a name such as 'FULL_SHARD' or torch's ShardingStrategy)"
            )
        self.reshard_after_forward = _torch_enum(ShardingStrategy, self.reshard_after_forward, _FSDP_SHARDING)

    def _reshard_as_bool(self) -> None:
        if isinstance(self.reshard_after_forward, str):
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

    def _set_cpu_offload(self, two: bool) -> None:
        """`cpu_offload` as torch's object of this version (a bool, or from `FSDP_OFFLOAD_PARAMS`)."""
        if self.cpu_offload is None:
            self.cpu_offload = _env_bool(_FSDP_ENV + "OFFLOAD_PARAMS")
        if two and isinstance(self.cpu_offload, bool):
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

            self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        elif isinstance(self.cpu_offload, bool):
            from torch.distributed.fsdp import CPUOffload

            self.cpu_offload = CPUOffload(offload_params=self.cpu_offload)

    def _set_backward_prefetch(self, two: bool) -> None:
        """`backward_prefetch` as torch's `BackwardPrefetch` (FSDP1) or None (FSDP2, which prefetches on its own)."""
        if self.backward_prefetch is None:
            self.backward_prefetch = os.environ.get(_FSDP_ENV + "BACKWARD_PREFETCH")
        if isinstance(self.backward_prefetch, str) and self.backward_prefetch.upper() == "NO_PREFETCH":
            self.backward_prefetch = None
        if self.backward_prefetch is not None:
            from torch.distributed.fsdp import BackwardPrefetch

            self.backward_prefetch = _torch_enum(BackwardPrefetch, self.backward_prefetch, _FSDP_PREFETCH)
        if two and self.backward_prefetch is not None:
            # Accelerate drops the field too, and warns in these words
            _logger.warning("backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.")
            self.backward_prefetch = None

    def _set_wrapping(self) -> None:
        """`auto_wrap_policy` named (or from `FSDP_AUTO_WRAP_POLICY`) becomes torch's policy function, with the
        field it reads (`transformer_cls_names_to_wrap` or `min_num_params`) filled from the environment."""
        env = os.environ
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

    def _set_version_specific_flags(self, two: bool) -> None:
        """FSDP1's `use_orig_params`, `sync_module_states` and `forward_prefetch`: from the environment, or
        dropped under FSDP2 (Accelerate drops them too)."""
        if two:
            self.use_orig_params = None
            self.sync_module_states = None
            if self.forward_prefetch:
                raise ValueError(
                    "forward_prefetch is not yet implemented in FSDP2, set to None or use `fsdp_version=1`"
                )
            self.forward_prefetch = None
            return
        if self.use_orig_params is None:
            self.use_orig_params = _env_bool(_FSDP_ENV + "USE_ORIG_PARAMS")
        if self.sync_module_states is None:
            self.sync_module_states = _env_bool(_FSDP_ENV + "SYNC_MODULE_STATES")
        if self.forward_prefetch is None:
            self.forward_prefetch = _env_bool(_FSDP_ENV + "FORWARD_PREFETCH")

    def _set_activation_checkpointing(self, two: bool) -> None:
        if self.activation_checkpointing is None:
            self.activation_checkpointing = _env_bool(_FSDP_ENV + "ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _env_bool(_FSDP_ENV + "ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise ValueError("`activation_checkpointing_offload=True` requires `activation_checkpointing=True`.")
        if self.activation_checkpointing_offload and not two:
            raise ValueError("`activation_checkpointing_offload=True` requires `fsdp_version=2`.")

    def _set_loading(self, two: bool) -> None:
        """`ignored_modules` and `cpu_ram_efficient_loading` (which FSDP1 needs `sync_module_states` for)."""
        if self.ignored_modules is None:
            self.ignored_modules = os.environ.get(_FSDP_ENV + "IGNORED_MODULES")
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _env_bool(_FSDP_ENV + "CPU_RAM_EFFICIENT_LOADING")
        else:
            # Transformers reads it when loading weights
            os.environ[_FSDP_ENV + "CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading)
        if not two and self.cpu_ram_efficient_loading:
            self.sync_module_states = True

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
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

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


__all__ = ["FullyShardedDataParallelPlugin", "check_version", "layer_classes_to_wrap", "FSDP1_REFUSED"]
