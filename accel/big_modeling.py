"""Models larger than one device: create them without memory, load them where they fit, run them there.

- `init_empty_weights()` / `init_on_device(device)`: build a model with its parameters on the
  meta device (no memory) or directly on a device.
- `infer_auto_device_map` (in `accel.utils.modeling`) plans where each block goes within
  `max_memory`; `load_checkpoint_in_model` loads the weights there.
- `dispatch_model(model, device_map)` runs each block on its device (hooks move the
  activations), blocks mapped to "cpu" are offloaded: kept on the CPU and brought to the
  main device for their forward; `load_checkpoint_and_dispatch` does all of it.
- `cpu_offload` / `cpu_offload_with_hook`: a whole model kept on the CPU between forwards.

- `disk_offload` / "disk" in a device map: weights kept in an offload folder (one
  memory-mapped file per tensor, Accelerate's layout: `accel.utils.offload`) and loaded for
  each forward.
- `attach_layerwise_casting_hooks`: the linear and convolution layers of a model stored in a
  small dtype (float8, fp16...) and cast to the compute dtype for their forward only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from accel.hooks import (
    AlignDevicesHook,
    CpuOffload,
    LayerwiseCastingHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
)
from accel.utils.environment import parse_flag_from_env
from accel.utils.modeling import (
    check_device_map,
    find_tied_parameters,
    get_balanced_memory,
    infer_auto_device_map,
    load_checkpoint_in_model,
    retie_parameters,
)

_TENSOR_FACTORIES = ("empty", "zeros", "ones", "full")

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models inside the block with their parameters on the meta device: no memory is used.

    Buffers stay on the CPU unless `include_buffers` (default: `ACCELERATE_INIT_INCLUDE_BUFFERS`).
    Materialise the weights afterwards with `load_checkpoint_and_dispatch`, or
    `model.to_empty(device=...)` and an initialisation.
    """
    if include_buffers is None:
        include_buffers = parse_flag_from_env("ACCELERATE_INIT_INCLUDE_BUFFERS", False)
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Build models inside the block with their parameters (and buffers with `include_buffers`) on `device`.

    Parameters are created where torch creates them and moved to `device` as they are
    registered, keeping their class and `requires_grad`. With `include_buffers`, the
    tensor factories (`torch.empty`, `zeros`, `ones`, `full`) also default to `device`.
    """
    if include_buffers is None:
        include_buffers = parse_flag_from_env("ACCELERATE_INIT_INCLUDE_BUFFERS", False)
    device = torch.device(device)
    if include_buffers:
        with device:  # torch's device context: factories, parameters and buffers all land on `device`
            yield
        return
    original_register = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_register(module, name, param)
        if param is not None:
            moved = module._parameters[name]
            assert moved is not None
            kwargs = dict(moved.__dict__)
            kwargs["requires_grad"] = moved.requires_grad
            module._parameters[name] = type(moved)(moved.to(device), **kwargs)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_register  # type: ignore[method-assign]


def cpu_offload(
    model: nn.Module,
    execution_device: torch.device | str | int | None = None,
    offload_buffers: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep `model`'s weights on the CPU and bring each submodule's to `execution_device` only for its forward.

    The weights live in `state_dict` (default: the model's own, copied to the CPU); the
    model's parameters sit on the meta device in between. Outputs come back on the device
    of the inputs. `execution_device` defaults to this process's device.
    """
    if execution_device is None:
        from accel.state import PartialState

        execution_device = PartialState().default_device
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=state_dict,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep `model` whole on the CPU and move it to `execution_device` when it runs; it stays there until
    `hook.offload()` (or the next model's forward, when that one was given this hook as `prev_module_hook`).

    Returns `(model, hook)`. Better than `cpu_offload` for models called in a loop (pipelines).
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: torch.device | str | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep `model`'s weights in `offload_dir` (one memory-mapped file each) and load each submodule's for its forward.

    The weights are written there first unless the folder already holds an `index.json`.
    `execution_device` defaults to the device of the model's first parameter.
    """
    from accel.utils.offload import INDEX_NAME, OffloadedWeightsLoader, offload_state_dict

    if not os.path.isfile(os.path.join(offload_dir, INDEX_NAME)):
        offload_state_dict(offload_dir, model.state_dict())
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=OffloadedWeightsLoader(save_folder=offload_dir),
        preload_module_classes=preload_module_classes,
    )
    return model


def _main_device(device_map: Mapping[str, Any]) -> Any:
    devices = list(device_map.values())
    if set(map(str, devices)) <= {"cpu", "disk"}:
        return "cpu"
    return next(d for d in devices if str(d) not in ("cpu", "disk"))


def dispatch_model(
    model: nn.Module,
    device_map: dict[str, Any],
    main_device: torch.device | str | int | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: dict[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Run each block of `model` on the device `device_map` gives it.

    Hooks move the activations from block to block, and the outputs back to the inputs'
    device. Blocks mapped to "cpu" are offloaded: their weights stay in host memory and
    run on `main_device` (default: the first GPU of the map). A map with a single device
    and no `force_hooks` simply moves the model there. The map is kept as
    `model.hf_device_map`. Blocks mapped to "disk" are offloaded too, their weights read from
    `offload_dir` (written there first when it has no index yet).
    """
    check_device_map(model, device_map)
    disk_modules = _modules_on(device_map, "disk")
    if disk_modules and offload_dir is None and offload_index is None:
        raise ValueError(
            "We need an `offload_dir` to dispatch this model according to this `device_map`, the following "
            f"submodules need to be offloaded: {', '.join(disk_modules)}."
        )
    devices = set(map(str, device_map.values()))
    if len(devices) == 1 and not devices & {"cpu", "disk"} and not force_hooks:
        model.to(next(iter(device_map.values())))
        setattr(model, "hf_device_map", dict(device_map))  # noqa: B010
        return model
    if main_device is None:
        main_device = _main_device(device_map)
    weights_map = _offloaded_weights(model, device_map, state_dict, offload_dir, offload_index)
    offloaded = ("cpu", "disk")
    execution = {name: main_device if str(device) in offloaded else device for name, device in device_map.items()}
    offload = {name: str(device) in offloaded for name, device in device_map.items()}
    tied = find_tied_parameters(model)
    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution,
        offload=offload,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=_tied_params_map(model, tied),
    )
    retie_parameters(model, tied)
    setattr(model, "hf_device_map", dict(device_map))  # noqa: B010
    _warn_on_move(model)
    return model


def _modules_on(device_map: Mapping[str, Any], where: str) -> list[str]:
    """The names of the blocks `device_map` puts on `where` ("cpu", "disk")."""
    return [name for name, device in device_map.items() if str(device) == where]


def _weights_of(model: nn.Module, modules: list[str]) -> dict[str, torch.Tensor]:
    """The entries of `model`'s state dict inside `modules` ("" is the whole model), copied to the CPU."""
    return {
        key: value.to("cpu")
        for key, value in model.state_dict().items()
        if any(key == m or key.startswith(m + ".") or m == "" for m in modules)
    }


def _offloaded_weights(
    model: nn.Module,
    device_map: Mapping[str, Any],
    state_dict: dict[str, torch.Tensor] | None,
    offload_dir: str | os.PathLike | None,
    offload_index: dict[str, Any] | None,
) -> Any:
    """Where the offloaded blocks' weights are read from: `state_dict` (default: the "cpu" blocks' weights),
    joined for "disk" blocks by the offload folder, written first when it has no index yet."""
    cpu_modules = _modules_on(device_map, "cpu")
    if state_dict is None and cpu_modules:
        state_dict = _weights_of(model, cpu_modules)
    disk_modules = _modules_on(device_map, "disk")
    if not disk_modules:
        return state_dict
    from accel.utils.offload import INDEX_NAME, OffloadedWeightsLoader, offload_state_dict

    on_disk = offload_index is not None or os.path.isfile(os.path.join(offload_dir, INDEX_NAME))  # type: ignore[arg-type]
    if not on_disk:  # weights still in the model (not loaded with load_checkpoint_in_model): write them
        offload_state_dict(offload_dir, _weights_of(model, disk_modules))  # type: ignore[arg-type]
    return OffloadedWeightsLoader(state_dict=state_dict, save_folder=offload_dir, index=offload_index)


def _tied_params_map(model: nn.Module, tied: list[list[str]]) -> dict[int, dict[torch.device, torch.Tensor]]:
    """The hooks' record of tied weights (data pointer -> {device: tensor}, one per tied parameter off the meta
    device), so that a weight shared by several blocks is loaded once per device."""
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] = {}
    for group in tied:
        for name in group:
            param = model.get_parameter(name)
            if param.device.type != "meta":
                tied_params_map[param.data_ptr()] = {}
    return tied_params_map


def _warn_on_move(model: nn.Module) -> None:
    """`model.to` / `model.cuda` warn from now on: moving a dispatched model bypasses its hooks."""
    from accel.hooks import WarnOnMove

    model.to = WarnOnMove(model.to, model)  # type: ignore[method-assign]
    model.cuda = WarnOnMove(model.cuda, model)  # type: ignore[method-assign]


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load `checkpoint` into `model` (typically built under `init_empty_weights`) and dispatch it.

    `device_map` is a dict, or "auto" / "balanced" (spread evenly over the GPUs),
    "balanced_low_0" (GPU 0 as empty as possible), "sequential" (fill GPUs in order),
    planned within `max_memory` by `infer_auto_device_map`. Without a device map, the
    weights are loaded where the model's tensors are (the CPU for meta ones) and nothing
    is dispatched.
    """
    if isinstance(device_map, str):
        device_map = _planned_device_map(model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers)
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


def _planned_device_map(
    model: nn.Module,
    strategy: str,
    max_memory: dict[int | str, int | str] | None,
    no_split_module_classes: list[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
) -> dict[str, Any]:
    """The device map `infer_auto_device_map` plans for a named `strategy` ("auto", "balanced"...), within
    `max_memory`; every strategy but "sequential" first balances that memory over the GPUs (`get_balanced_memory`)."""
    choices = ("auto", "balanced", "balanced_low_0", "sequential")
    if strategy not in choices:
        raise ValueError(f"device_map={strategy!r}: give a dict or one of {choices}")
    planned: dict[int | str, int | str] | None = max_memory
    if strategy != "sequential":
        balanced = get_balanced_memory(
            model,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            low_zero=(strategy == "balanced_low_0"),
        )
        planned = dict(balanced)
    return infer_auto_device_map(
        model,
        max_memory=planned,
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
        offload_buffers=offload_buffers,
    )


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Keep the weights of `module`'s linear and convolution layers (`SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING`)
    in `storage_dtype`, cast to `compute_dtype` for each layer's forward only (a `LayerwiseCastingHook` each).

    Other layers (norms, embeddings...) keep their dtype. A module whose dotted name matches one of
    `skip_modules_pattern` (regular expressions, searched in the name; one string is one pattern) or whose
    class is one of `skip_modules_classes` is left as it is, with everything inside it. The inputs are not
    cast: give the model inputs of `compute_dtype`.
    """
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else skip_modules_pattern
    compiled = [re.compile(pattern) for pattern in patterns or ()]
    classes = tuple(skip_modules_classes or ())
    if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        raise TypeError(f"skip_modules_classes must hold nn.Module subclasses, got {skip_modules_classes!r}")
    # checked once here, so that a bad dtype fails before any layer is cast
    LayerwiseCastingHook(storage_dtype=storage_dtype, compute_dtype=compute_dtype, non_blocking=non_blocking)
    _cast_layerwise(module, "", storage_dtype, compute_dtype, compiled, classes, non_blocking)


def _cast_layerwise(
    module: nn.Module,
    name: str,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    patterns: list[re.Pattern[str]],
    classes: tuple[type[nn.Module], ...],
    non_blocking: bool,
) -> None:
    from accel.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING

    if isinstance(module, classes) or any(pattern.search(name) for pattern in patterns):
        logger.debug("layerwise casting skips %r", name)
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        logger.debug("layerwise casting of %r", name)
        hook = LayerwiseCastingHook(storage_dtype=storage_dtype, compute_dtype=compute_dtype, non_blocking=non_blocking)
        add_hook_to_module(module, hook, append=True)
        return
    for child_name, child in module.named_children():
        child_path = f"{name}.{child_name}" if name else child_name
        _cast_layerwise(child, child_path, storage_dtype, compute_dtype, patterns, classes, non_blocking)


__all__ = [
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
]
