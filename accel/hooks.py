"""Hooks around a module's forward: what big-model dispatch and CPU offload are built on.

A `ModelHook` sees a module when it is attached (`init_hook`), before each forward
(`pre_forward`, may change the arguments), after it (`post_forward`, may change the
output) and when removed (`detach_hook`). `add_hook_to_module` installs one (the
original forward is kept in `module._old_forward`, the hook in `module._hf_hook`, as
Accelerate names them, so code written for either library finds them);
`remove_hook_from_module` puts the module back as it was.

`AlignDevicesHook` runs a module on its execution device: it moves the inputs there and,
when the module is offloaded, loads its weights from a weights map (CPU tensors) for the
forward only, leaving them on the meta device in between. `CpuOffload` moves a whole
model to its execution device for its forward and back to the CPU when the next model
in a pipeline starts (`cpu_offload_with_hook`). `LayerwiseCastingHook` keeps a layer's
weights in a low-precision storage dtype and casts them to the compute dtype for its
forward only (`attach_layerwise_casting_hooks`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accel.utils.module_tensors import get_non_persistent_buffers, named_module_tensors, set_module_tensor_to_device
from accel.utils.operations import find_device, send_to_device


class ModelHook:
    """Base hook: every method is a no-op; subclasses override what they need.

    `no_grad = True` runs the hooked forward under `torch.no_grad()`.
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached; returns the module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Called before the forward with its arguments; returns the (args, kwargs) to call it with."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward with its output; returns the output to give back."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks in turn (pre-forwards in order, post-forwards in order too, as Accelerate runs them)."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


class HookedForward:
    """The forward installed by `add_hook_to_module` (a class, so that hooked modules pickle when their hook does)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # the name, docstring and signature of the forward it stands for (`__wrapped__`)
        functools.update_wrapper(self, module._old_forward)  # type: ignore[arg-type]  # set just before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        hook: ModelHook = module._hf_hook  # type: ignore[assignment]  # set by add_hook_to_module
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        if hook.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)  # type: ignore[operator]
        else:
            output = module._old_forward(*args, **kwargs)  # type: ignore[operator]
        return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Run `module`'s forward through `hook`; returns the module (changed in place).

    A module already hooked gets its hook replaced (its old hook is detached first), or,
    with `append=True`, chained after it in a `SequentialHook`.
    """
    existing = getattr(module, "_hf_hook", None)
    if append and existing is not None:
        old_hook = existing
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    elif existing is not None:
        remove_hook_from_module(module)
    module = hook.init_hook(module)
    # setattr: nn.Module's attribute typing only knows tensors and modules
    setattr(module, "_old_forward", module.forward)  # noqa: B010
    setattr(module, "_hf_hook", hook)  # noqa: B010
    module.forward = HookedForward(module)
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Remove the hook of `module` (and of its submodules with `recurse=True`), detaching it; returns the module."""
    for name in ("to", "cuda"):  # the move warnings dispatch_model adds
        if isinstance(module.__dict__.get(name), WarnOnMove):
            del module.__dict__[name]
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
        old_forward = module.__dict__.pop("_old_forward")
        module.__dict__.pop("forward", None)
        if getattr(old_forward, "__self__", None) is not module or getattr(old_forward, "__func__", None) is not (
            type(module).forward
        ):
            module.forward = old_forward  # an instance-level forward that predates the hook
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of `module` and of every submodule."""
    remove_hook_from_module(module, recurse=True)


def _names_a_device(*args: Any, **kwargs: Any) -> bool:
    """Whether `Module.to(*args, **kwargs)` names a device (`Module.to`'s device is not None).

    Read from `Module.to`'s documented forms, with public types only: `to(device=None,
    dtype=None, non_blocking=False)`, `to(dtype, non_blocking=False)`, `to(tensor,
    non_blocking=False)` (the tensor's device), `to(memory_format=...)`; each argument may
    also be given by name. Arguments torch refuses are left for the move itself to refuse.
    """
    if kwargs.get("device") is not None or isinstance(kwargs.get("tensor"), torch.Tensor):
        return True
    return bool(args) and args[0] is not None and not isinstance(args[0], torch.dtype)


class WarnOnMove:
    """`model.to` / `model.cuda` of a dispatched model: warns that moving it bypasses its hooks, and refuses
    while some weights are offloaded (on the meta device)."""

    def __init__(self, move: Any, model: nn.Module) -> None:
        self.move = move
        self.model = model
        functools.update_wrapper(self, move)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import logging

        moving = True
        if getattr(self.move, "__name__", "") == "to":
            moving = _names_a_device(*args, **kwargs)
        if moving:
            # Accelerate's words and logger name (users' tests look for them)
            logging.getLogger("accel.big_modeling").warning(
                "You shouldn't move a model that is dispatched using accelerate hooks."
            )
        if any(p.device.type == "meta" for p in self.model.parameters()):
            raise RuntimeError("You can't move a model that has some modules offloaded to cpu or disk.")
        return self.move(*args, **kwargs)


class AlignDevicesHook(ModelHook):
    """Run a module on `execution_device`, loading offloaded weights for the forward only.

    Args:
        execution_device: where the forward computes; inputs are moved there.
        offload: keep the module's weights on the meta device between forwards and load
            them from `weights_map` for each forward.
        io_same_device: give the outputs back on the device of the first input.
        weights_map: name -> tensor (relative to the module) of the offloaded weights
            (default: the module's own, copied to the CPU when attached).
        offload_buffers: offload the buffers too (otherwise they live on the execution device).
        place_submodules: the hook manages the submodules' tensors as well as the module's own.
        skip_keys: keyword arguments not moved to the execution device.
        tied_params_map: data pointer -> {device: tensor}, so that tied weights are loaded once.
    """

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    ) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device: torch.device | None = None
        self.param_original_devices: dict[str, torch.device] = {}
        self.buffer_original_devices: dict[str, torch.device] = {}
        self.tied_pointers_to_remove: set[tuple[int, torch.device]] = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _tensors(self, module: nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
        return list(
            named_module_tensors(
                module, include_buffers=include_buffers, recurse=self.place_submodules, remove_non_persistent=True
            )
        )

    def _execution_device(self) -> int | str | torch.device:
        if self.execution_device is None:
            raise ValueError("this AlignDevicesHook offloads weights but has no execution_device to load them on")
        return self.execution_device

    def init_hook(self, module: nn.Module) -> nn.Module:
        if self.execution_device == "meta" or self.execution_device == torch.device("meta"):
            self.tied_params_map = None
        if not self.offload and self.execution_device is not None:
            # every tensor, non-persistent buffers included
            for name, _ in module.named_parameters(recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)
            for name, _ in module.named_buffers(recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)
        elif self.offload:
            self.param_original_devices = {
                name: p.device for name, p in module.named_parameters(recurse=self.place_submodules)
            }
            self.buffer_original_devices = {
                name: b.device for name, b in module.named_buffers(recurse=self.place_submodules)
            }
            if self.weights_map is None:
                self.weights_map = {
                    name: t.detach().to("cpu")
                    for name, t in self._tensors(module, include_buffers=self.offload_buffers)
                }
            for name, _ in self._tensors(module, include_buffers=self.offload_buffers):
                set_module_tensor_to_device(module, name, "meta")
            if not self.offload_buffers and self.execution_device is not None:
                for name, _ in module.named_buffers(recurse=self.place_submodules):
                    set_module_tensor_to_device(
                        module, name, self.execution_device, tied_params_map=self.tied_params_map
                    )
            elif self.execution_device is not None:
                # non-persistent buffers are in no weights map: they live on the execution device
                for name in get_non_persistent_buffers(module, recurse=self.place_submodules, fqns=True):
                    set_module_tensor_to_device(
                        module, name, self.execution_device, tied_params_map=self.tied_params_map
                    )
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            assert self.weights_map is not None  # set by init_hook
            self.tied_pointers_to_remove = set()
            for name, _ in self._tensors(module, include_buffers=self.offload_buffers):
                if name not in self.weights_map:
                    raise KeyError(
                        f"offloaded weight {name!r} of {type(module).__name__} is not in the hook's weights_map "
                        f"(it has {sorted(self.weights_map)[:10]}...): build the map from this module's state_dict"
                    )
                value = self.weights_map[name]
                if self.tied_params_map is not None and value.data_ptr() in self.tied_params_map:
                    self.tied_pointers_to_remove.add((value.data_ptr(), torch.device(self.execution_device)))  # type: ignore[arg-type]
                set_module_tensor_to_device(
                    module, name, self._execution_device(), value=value, tied_params_map=self.tied_params_map
                )
        if self.execution_device is None:
            return args, kwargs
        return (
            send_to_device(args, self.execution_device),
            send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            for name, _ in self._tensors(module, include_buffers=self.offload_buffers):
                set_module_tensor_to_device(module, name, "meta")
            if self.tied_params_map is not None:
                for pointer, device in self.tied_pointers_to_remove:
                    self.tied_params_map.get(pointer, {}).pop(device, None)
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self.offload and self.weights_map is not None:
            originals = {**self.param_original_devices, **self.buffer_original_devices}
            for name, device in originals.items():
                if device != torch.device("meta") or name not in self.weights_map:
                    continue
                set_module_tensor_to_device(module, name, "cpu", value=self.weights_map[name])
            for name, device in originals.items():
                if device != torch.device("meta"):
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name))
        return module


def _prefixed(weights_map: Mapping[str, torch.Tensor] | None, prefix: str) -> Mapping[str, torch.Tensor] | None:
    if weights_map is None or not prefix:
        return weights_map
    return PrefixedDataset(weights_map, prefix)


class PrefixedDataset(Mapping):
    """A read-only view of `dataset` whose keys are those starting with `prefix`, with the prefix removed."""

    def __init__(self, dataset: Mapping[str, Any], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Any:
        return iter(key[len(self.prefix) :] for key in self.dataset if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device | None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give `module` and its submodules with weights a hook that only moves inputs to `execution_device`."""
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(
            module, AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        )
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach an `AlignDevicesHook` to every submodule of `module` that holds weights of its own.

    `weights_map` is keyed by names relative to `module_name`'s module. Modules whose
    class is in `preload_module_classes` load all their weights (their submodules' too)
    at the start of their forward.
    """
    own: list[tuple[str, torch.Tensor]] = list(module.named_parameters(recurse=False))
    if offload_buffers:
        own += list(module.named_buffers(recurse=False))
    full_offload = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if own or full_offload:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=_prefixed(weights_map, prefix),
            offload_buffers=offload_buffers,
            place_submodules=full_offload,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for name, child in module.named_children():
        child_name = f"{module_name}.{name}" if module_name else name
        attach_align_device_hook(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: int | str | torch.device | Mapping[str, Any] | None = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach hooks block by block: `execution_device` and `offload` map block names (a device map's keys) to values."""
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        _attach_to_whole_model(
            module, execution_device, offload, weights_map, offload_buffers, module_name, skip_keys, tied_params_map
        )
        return
    devices = execution_device if isinstance(execution_device, Mapping) else dict.fromkeys(offload, execution_device)  # type: ignore[arg-type]
    offloads = offload if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    if module_name in devices and module_name in offloads and not offloads[module_name]:
        _attach_to_resident_block(
            module, module_name, devices[module_name], offload_buffers, skip_keys, tied_params_map
        )
    elif module_name in devices and module_name in offloads:
        _attach_to_offloaded_block(
            module,
            module_name,
            devices[module_name],
            weights_map,
            offload_buffers,
            skip_keys,
            preload_module_classes,
            tied_params_map,
        )
    elif module_name == "":
        hook = AlignDevicesHook(execution_device=devices.get(""), io_same_device=True, skip_keys=skip_keys)
        add_hook_to_module(module, hook)
    for name, child in module.named_children():
        child_name = f"{module_name}.{name}" if module_name else name
        attach_align_device_hook_on_blocks(
            child,
            execution_device=devices,
            offload=offloads,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


def _attach_to_whole_model(
    module: nn.Module,
    execution_device: int | str | torch.device | None,
    offload: bool,
    weights_map: Mapping[str, torch.Tensor] | None,
    offload_buffers: bool,
    module_name: str,
    skip_keys: str | list[str] | None,
    tied_params_map: dict | None,
) -> None:
    """One device and one offload choice for the whole model: a single hook that runs it all on the device, or
    offloading hooks on every submodule with weights."""
    if not offload:
        hook = AlignDevicesHook(
            execution_device=execution_device,
            io_same_device=True,
            skip_keys=skip_keys,
            place_submodules=True,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook)
        return
    attach_align_device_hook(
        module,
        execution_device=execution_device,
        offload=True,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        module_name=module_name,
        skip_keys=skip_keys,
        tied_params_map=tied_params_map,
    )


def _attach_to_resident_block(
    module: nn.Module,
    module_name: str,
    device: Any,
    offload_buffers: bool,
    skip_keys: str | list[str] | None,
    tied_params_map: dict | None,
) -> None:
    """A block that lives on `device`: one hook places all its weights there; its submodules move inputs there."""
    hook = AlignDevicesHook(
        execution_device=device,
        offload_buffers=offload_buffers,
        io_same_device=(module_name == ""),
        place_submodules=True,
        skip_keys=skip_keys,
        tied_params_map=tied_params_map,
    )
    add_hook_to_module(module, hook)
    attach_execution_device_hook(module, device, skip_keys=skip_keys, tied_params_map=tied_params_map)


def _attach_to_offloaded_block(
    module: nn.Module,
    module_name: str,
    device: Any,
    weights_map: Mapping[str, torch.Tensor] | None,
    offload_buffers: bool,
    skip_keys: str | list[str] | None,
    preload_module_classes: list[str] | None,
    tied_params_map: dict | None,
) -> None:
    """A block whose weights are offloaded: hooks load each submodule's weights onto `device` for its forward
    (the block itself gets one that moves inputs when it has no weights of its own)."""
    attach_align_device_hook(
        module,
        execution_device=device,
        offload=True,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        module_name=module_name,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    if not hasattr(module, "_hf_hook"):
        hook = AlignDevicesHook(
            execution_device=device,
            io_same_device=(module_name == ""),
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook)
    attach_execution_device_hook(
        module,
        device,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )


class CpuOffload(ModelHook):
    """Keep a whole model on the CPU and move it to `execution_device` for its forward.

    With `prev_module_hook` (a `UserCpuOffloadHook`), the previous model of a pipeline is
    sent back to the CPU when this one starts.
    """

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            from accel.state import PartialState

            execution_device = PartialState().default_device
        self.execution_device = execution_device

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """Returned by `cpu_offload_with_hook`: `offload()` sends the model back to the CPU, `remove()` unhooks it."""

    def __init__(self, model: nn.Module, hook: ModelHook) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


class LayerwiseCastingHook(ModelHook):
    """Store a module's floating-point weights in `storage_dtype` and compute in `compute_dtype`.

    Attached, the module is cast to `storage_dtype`; each forward casts it to `compute_dtype`
    first and back to `storage_dtype` after, so that only the running layer is held in the
    larger dtype. Precision lost to the storage dtype is not recovered.
    """

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        for name, dtype in (("storage_dtype", storage_dtype), ("compute_dtype", compute_dtype)):
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(f"LayerwiseCastingHook: {name} must be a floating-point torch.dtype, got {dtype!r}")
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output
