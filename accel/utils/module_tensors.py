"""A module's own tensors: listing its parameters and buffers by name, and putting one of them on a device.

Below both `accel.utils.modeling` (device maps, checkpoint loading) and `accel.hooks` (which
place offloaded weights around each forward): both import it, and it imports neither.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of `module` (its own, or all with `recurse`), then its buffers with `include_buffers`
    (without the non-persistent ones when `remove_non_persistent`)."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skipped = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skipped:
                yield name, buffer


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers of `module` that are not in its state dict (with `recurse`, its submodules' too:
    by bare name, or by name relative to `module` with `fqns`). A new set: the module is not changed."""
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, child in module.named_modules():
            if prefix:
                own = child._non_persistent_buffers_set
                names |= {f"{prefix}.{n}" for n in own} if fqns else set(own)
    return names


def submodule_and_leaf(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The submodule that owns the dotted `tensor_name` of `module`, and the tensor's name within it."""
    *path, leaf = tensor_name.split(".")
    for part in path:
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            raise ValueError(f"{type(module).__name__} has no submodule {part!r} (looking for {tensor_name!r})")
        module = child
    return module, leaf


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`dtype` as a `torch.dtype`, also when named ("float16", "torch.float16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.replace("torch.", "")
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return found


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer `tensor_name` (dotted) of `module` on `device`, with `value`'s data if given.

    A meta tensor needs a `value` to go anywhere but the meta device. `dtype` casts the
    value (floating values only take the module's dtype when `dtype` is not given, as
    Accelerate does). Parameters stay `nn.Parameter`s of the same class with their
    `requires_grad`. `tied_params_map` (data pointer -> {device: tensor}) lets tied
    weights share one copy per device.
    """
    if fp16_statistics is not None:
        raise ValueError("fp16_statistics is for bitsandbytes 8-bit weights, which accel does not load")
    submodule, name = submodule_and_leaf(module, tensor_name)
    if name not in submodule._parameters and name not in submodule._buffers:
        raise ValueError(f"{type(submodule).__name__} has no parameter or buffer named {name!r} ({tensor_name!r})")
    is_buffer = name in submodule._buffers
    old = submodule._buffers[name] if is_buffer else submodule._parameters[name]
    device = torch.device(device) if not isinstance(device, int) else torch.device(_default_device_type(), device)
    if old is None:
        raise ValueError(f"{tensor_name!r} of {type(submodule).__name__} is None: nothing to place")
    if old.device.type == "meta" and value is None and device.type != "meta":
        raise ValueError(f"{tensor_name} is on the meta device: pass a `value` to put it on {device}")
    if value is not None:
        value = _value_for(old, value, name, dtype)
    new_value = _placed(old, value, device, dtype, tied_params_map, non_blocking)
    _replace_tensor(submodule, name, old, new_value, is_buffer)


def _default_device_type() -> str:
    """The accelerator type that a bare device index names (Accelerate: `0` is `cuda:0` on a GPU host)."""
    if torch.cuda.is_available():
        return "cuda"
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None:
            return current.type
    raise ValueError("a bare device index names a GPU, but this process sees none; name the device ('cpu')")


def _value_for(old: torch.Tensor, value: torch.Tensor, name: str, dtype: str | torch.dtype | None) -> torch.Tensor:
    """`value` checked against the shape of the tensor `old` it replaces, in the dtype it will be stored in."""
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if (
        tuple(value.shape) != tuple(old.shape)
        and old.device.type != "meta"
        or (old.device.type == "meta" and tuple(value.shape) != tuple(old.shape))
    ):
        raise ValueError(  # Accelerate's words
            f'Trying to set a tensor of shape {value.shape} in "{name}" (which has shape {old.shape}), this looks '
            "incorrect."
        )
    if dtype is not None:
        return value.to(as_dtype(dtype))
    if value.is_floating_point() and old.is_floating_point():
        return value.to(old.dtype)
    return value


def _placed(
    old: torch.Tensor,
    value: torch.Tensor | None,
    device: torch.device,
    dtype: str | torch.dtype | None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None,
    non_blocking: bool,
) -> torch.Tensor:
    """The tensor to store on `device`: `value`'s data (else `old`'s), or the copy that a tied weight already
    has there; a new copy of a tied weight is recorded in `tied_params_map` for its twins."""
    copies = tied_params_map.get(value.data_ptr()) if tied_params_map is not None and value is not None else None
    if copies is not None and device in copies:
        return copies[device]
    source = old if value is None else value
    if device.type == "meta":  # no data to copy: a meta tensor of the same shape and dtype
        new_value = torch.empty_like(source.detach(), device="meta")
    else:
        new_value = source.detach().to(device, non_blocking=non_blocking)
    if dtype is not None and value is None:
        new_value = new_value.to(as_dtype(dtype))
    if copies is not None:
        copies[device] = new_value
    return new_value


def _replace_tensor(
    submodule: nn.Module, name: str, old: torch.Tensor, new_value: torch.Tensor, is_buffer: bool
) -> None:
    """Store `new_value` as `submodule`'s buffer or parameter `name`; a parameter keeps `old`'s class and
    `requires_grad` (gradients only for floating and complex values)."""
    with torch.no_grad():
        if is_buffer:
            submodule._buffers[name] = new_value
            return
        param_cls = type(old)
        requires_grad = old.requires_grad if new_value.is_floating_point() or new_value.is_complex() else False
        if param_cls is nn.Parameter or not issubclass(param_cls, nn.Parameter):
            submodule._parameters[name] = nn.Parameter(new_value, requires_grad=requires_grad)
        else:
            submodule._parameters[name] = param_cls(new_value, requires_grad=requires_grad)


__all__ = ["named_module_tensors", "get_non_persistent_buffers", "set_module_tensor_to_device"]
