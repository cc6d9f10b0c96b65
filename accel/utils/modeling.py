"""The model as a whole: unwrapping it, sizing it, mapping it onto devices and loading weights into it.

- Unwrapping: `prepare()` may put a model inside `DistributedDataParallel` (or another
  wrapper with a `.module`), and users may hand it a `torch.compile`d model; saving, loading
  and inspecting want the plain `nn.Module` back (`extract_model_from_parallel`).
- Sizes and device maps: `compute_module_sizes`, `get_balanced_memory` and
  `infer_auto_device_map` plan where each submodule of a big model goes (GPUs, CPU, disk).
- Loading: `load_checkpoint_in_model` fills a model (possibly on the meta device) from a
  checkpoint, following a device map.

Placing one tensor of a module lives below, in `accel.utils.module_tensors` (re-exported
here), so that `accel.hooks` can use it without importing this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.utils.module_tensors import (  # noqa: F401  (public here too, as in Accelerate)
    as_dtype,
    get_non_persistent_buffers,
    named_module_tensors,
    set_module_tensor_to_device,
    submodule_and_leaf,
)

logger = logging.getLogger(__name__)


def is_compiled_module(module: Any) -> bool:
    """Whether `module` is the wrapper that `torch.compile` returns for an `nn.Module`."""
    # Checking sys.modules keeps `torch._dynamo` unimported when nobody compiled anything.
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def _is_parallel_wrapper(module: Any) -> bool:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return isinstance(module, (DistributedDataParallel, DataParallel))


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel / `torch.compile` wrappers.

    `keep_fp32_wrapper=False` also removes the mixed-precision forward that `prepare()`
    installed, so the returned module computes in its own dtype again.
    `keep_torch_compile=True` (the default, as in Accelerate) keeps the outer compiled
    wrapper, with its inside unwrapped; False returns the plain module. `recursive=True`
    also unwraps data-parallel wrappers found among the submodules.
    """
    compiled = model if is_compiled_module(model) else None
    inner: Any = model._orig_mod if compiled is not None else model
    while _is_parallel_wrapper(inner) or is_compiled_module(inner):
        inner = inner._orig_mod if is_compiled_module(inner) else inner.module
    if recursive:
        _unwrap_submodules(inner)
    if not keep_fp32_wrapper:
        remove_autocast_forward(inner)
        restore_original_forward(inner)
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = inner
        return compiled
    return inner


def _unwrap_submodules(module: torch.nn.Module) -> None:
    """Replace, in place, every data-parallel wrapper among the submodules by the module it wraps."""
    for name, child in list(module.named_children()):
        while _is_parallel_wrapper(child):
            child = child.module  # type: ignore[assignment]  # DDP/DataParallel.module is a Module
        setattr(module, name, child)
        _unwrap_submodules(child)


class AutocastForward:
    """A module's `forward` run under autocast, with low-precision float outputs cast to fp32.

    A class (not a closure) so that a module carrying it can still be pickled whole.
    """

    def __init__(self, forward: Any, make_context: Any) -> None:
        self.original = forward
        self.make_context = make_context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.make_context():
            outputs = self.original(*args, **kwargs)
        return outputs_to_fp32(outputs)


def install_autocast_forward(model: torch.nn.Module, make_context: Any) -> None:
    """Make `model(...)` run under the context returned by `make_context()` (mixed precision)."""
    if isinstance(model.__dict__.get("forward"), AutocastForward):
        return
    model.forward = AutocastForward(model.forward, make_context)


def remove_autocast_forward(model: torch.nn.Module) -> None:
    """Undo `install_autocast_forward` (no-op when it was not installed)."""
    patched = model.__dict__.get("forward")
    if isinstance(patched, AutocastForward):
        del model.forward
        if getattr(patched.original, "__self__", None) is not model:
            # The original forward was itself an instance attribute: put it back.
            model.forward = patched.original


def restore_original_forward(model: torch.nn.Module) -> None:
    """Undo forward wrappers applied over `model._original_forward` (Accelerate's convention).

    Code that wraps a forward (`model._original_forward = model.forward` then
    `model.forward = convert_outputs_to_fp32(autocast(model.forward))`) records the
    original; the wrappers are unwound through their `__wrapped__` and the original is put
    back (whatever wrappers were stacked over it): for the class's own `forward`, the instance
    attribute is removed, so the module pickles and behaves as before it was wrapped. No-op
    without `_original_forward`.
    """
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is getattr(
        type(model).forward, "__func__", type(model).forward
    ):
        model.__dict__.pop("forward", None)
    else:
        model.forward = original


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def outputs_to_fp32(value: Any) -> Any:
    """`value` with every fp16/bf16 tensor inside (nested lists, tuples, dicts) cast to fp32.

    Losses and metrics computed outside the model then run in full precision.
    """
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW_PRECISION else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(outputs_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(outputs_to_fp32(v) for v in value)
    if isinstance(value, dict):
        converted = {k: outputs_to_fp32(v) for k, v in value.items()}
        try:
            return type(value)(converted)
        except TypeError:
            return converted
    return value


# -- big-model utilities: sizes, tensors of a module, device maps, checkpoint loading ---------------

_SIZE_UNITS = {
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in `size`: an int, or a number with a unit ("5GB" decimal, "5GiB" binary; a trailing "b" means bits)."""
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size must be a non-negative number of bytes, got {size}")
        return size
    text = str(size).strip()
    upper = text.upper()
    for unit in sorted(_SIZE_UNITS, key=len, reverse=True):
        if upper.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                value = int(float(number) * _SIZE_UNITS[unit])
            except ValueError as error:
                raise ValueError(f"size {size!r}: {number!r} is not a number") from error
            if text.endswith("b"):  # "5Gb": gigabits
                value //= 8
            if value < 0:
                raise ValueError(f"size {size!r} is negative")
            return value
    raise ValueError(
        f"size {size!r} is not understood: give bytes (int) or a number with a unit such as '5GB' or '5GiB'"
    )


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element of `dtype` (1/8 for bool, fractions for sub-byte types such as int4)."""
    if dtype == torch.bool:
        return 1 / 8
    name = str(dtype)
    if name.endswith(("int4", "uint4")):
        return 0.5
    if name.endswith("int2") or name.endswith("uint2"):
        return 0.25
    if dtype.is_floating_point or dtype.is_complex:
        return torch.finfo(dtype).bits / 8 if not dtype.is_complex else torch.empty((), dtype=dtype).element_size()
    return torch.iinfo(dtype).bits / 8


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """What identifies `tensor`'s storage: (device, start pointer, size); tensors sharing memory give the same."""
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names (sorted) that are the same parameter object (tied weights), sorted."""
    names_of: dict[int, list[str]] = {}
    for prefix, submodule in model.named_modules(remove_duplicate=False):
        for name, param in submodule._parameters.items():
            if param is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            group = names_of.setdefault(id(param), [])
            if full not in group:
                group.append(full)
    return sorted(sorted(group) for group in names_of.values() if len(group) > 1)


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make each group of names in `tied_params` one parameter again (the first one's), after loading broke the ties."""
    for group in tied_params:
        shared = None
        for name in group:
            submodule, leaf = submodule_and_leaf(model, name)
            param = submodule._parameters.get(leaf)
            if param is not None and param.device.type != "meta":
                shared = param
                break
        if shared is None:
            submodule, leaf = submodule_and_leaf(model, group[0])
            shared = submodule._parameters[leaf]
        for name in group:
            submodule, leaf = submodule_and_leaf(model, name)
            submodule._parameters[leaf] = shared


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes of every submodule (and tensor) of `model`, keyed by name ("" is the whole model).

    `dtype` is the dtype the floating weights will be loaded in (only ever shrinks them);
    `special_dtypes` maps tensor names to their own dtype. Tied weights count once.
    """
    sizes: dict[str, int] = defaultdict(int)
    target = as_dtype(dtype) if dtype is not None else None
    specials = {k: as_dtype(v) for k, v in (special_dtypes or {}).items()}
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in specials:
            size = tensor.numel() * dtype_byte_size(specials[name])
        elif target is not None and tensor.is_floating_point():
            size = tensor.numel() * min(dtype_byte_size(target), dtype_byte_size(tensor.dtype))
        else:
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += int(size)
    return sizes  # a defaultdict, as Accelerate's: the second name of a tied weight (not counted) reads 0


def compute_module_total_buffer_size(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: dict[str, str | torch.dtype] | None = None
) -> int:
    """Bytes of all the buffers of `model`."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def _is_leaf_layer(module: Any, no_split_module_classes: list[str]) -> bool:
    return (
        not isinstance(module, nn.Module)
        or not list(module.children())
        or type(module).__name__ in no_split_module_classes
    )


def get_max_layer_size(
    modules: list[tuple[str, Any]], module_sizes: dict[str, int], no_split_module_classes: list[str]
) -> tuple[int, list[str]]:
    """Size of the largest layer among `modules` (a module without children, or of a no-split class) and their names."""
    best, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        if _is_leaf_layer(module, no_split_module_classes):
            size = module_sizes[name]
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            pending = [(f"{name}.{n}", c) for n, c in module.named_children()] + pending
    return best, names


def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
    """`max_memory` with sizes in bytes, GPUs first (by index) then "cpu", "disk"; or, when None, what is free now
    on every visible GPU (`torch.cuda.mem_get_info`) and in host memory."""
    if max_memory is None:
        import psutil

        found: dict[int | str, int] = {}
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                found[index] = int(torch.cuda.mem_get_info(index)[0])
        found["cpu"] = int(psutil.virtual_memory().available)
        return found
    sized = {key: convert_file_size_to_int(value) for key, value in max_memory.items()}
    unknown = [
        k for k in sized if not isinstance(k, int) and k not in ("cpu", "disk", "mps") and not _is_device_name(k)
    ]
    if unknown:
        raise ValueError(
            f"max_memory has keys {unknown}: use GPU indices (0, 1, ...), 'cuda:0'-style names, 'cpu' or 'disk'"
        )
    gpus = sorted(k for k in sized if isinstance(k, int))
    others = [k for k in sized if not isinstance(k, int) and k not in ("cpu", "disk")]
    order = gpus + others + [k for k in ("cpu", "disk") if k in sized]
    return {key: sized[key] for key in order}


def _is_device_name(key: Any) -> bool:
    try:
        torch.device(key)
    except (RuntimeError, TypeError):
        return False
    return True


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Merge, recursively, the entries under `module_name` into one when they all name the same device."""
    prefix = "" if module_name == "" else f"{module_name}."
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(map(str, values))) == 1 and len(values) > 1:
        for key in [k for k in device_map if k.startswith(prefix)]:
            del device_map[key]
        device_map[module_name] = values[0]
    children = {
        ".".join(k.split(".")[: len(module_name.split(".")) + 1 if module_name else 1])
        for k in device_map
        if k.startswith(prefix) and k != module_name and len(k) > len(prefix)
    }
    for child in children:
        if child != module_name:
            clean_device_map(device_map, module_name=child)
    return device_map


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    """Names in `module_sizes` that have no entry below them."""
    names = list(module_sizes)
    return [n for n in names if not any(other.startswith(n + ".") for other in names if other != n) and n != ""]


def get_balanced_memory(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """A `max_memory` that spreads the model evenly over the GPUs (for `device_map="balanced"`).

    Each GPU but the last gets the model's size divided by the number of GPUs plus a margin
    (1.25 times the largest no-split layer or the mean leaf), capped by its own memory;
    `low_zero` keeps GPU 0 as empty as possible (for generation buffers).
    """
    user_set = max_memory is not None
    memory = get_max_memory(max_memory)
    gpus = sorted(k for k, v in memory.items() if isinstance(k, int) and v > 0)
    if not gpus:
        return memory
    if len(gpus) == 1:
        low_zero = False
        if not user_set:
            memory[gpus[0]] = int(memory[gpus[0]] * 0.9)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    no_split = list(no_split_module_classes or [])
    buffer = 0
    if no_split:
        for name, submodule in model.named_modules():
            if name and type(submodule).__name__ in no_split:
                buffer = max(buffer, sizes.get(name, 0))
    inner = {n: v for n, v in sizes.items() if n not in set(get_module_leaves(sizes))}
    leaves = get_module_leaves(inner)
    mean_leaf = int(sum(inner[n] for n in leaves) / max(len(leaves), 1))
    per_gpu += int(1.25 * max(buffer, mean_leaf))
    for index in gpus[:-1]:
        memory[index] = min(memory[0] if low_zero and index == 0 else per_gpu, memory[index])
    if low_zero:
        rest = sum(memory[i] for i in gpus[1:])
        memory[gpus[0]] = min(max(0, sizes[""] - rest), memory[gpus[0]])
    return memory


def get_module_size_with_ties(
    tied_params: list[str], module_size: int, module_sizes: dict[str, int], modules_to_treat: list[tuple[str, Any]]
) -> tuple[int, list[str], list[Any]]:
    """Size of a module plus the modules (still to place) holding its tied parameters; their names and modules."""
    names: list[str] = []
    modules: list[Any] = []
    total = module_size
    for param in tied_params:
        match = next(((n, m) for n, m in modules_to_treat if param.startswith(n + ".")), None)
        if match is None:
            continue
        names.append(match[0])
        modules.append(match[1])
        total += module_sizes[match[0]] - module_sizes[param]
    return total, names, modules


def infer_auto_device_map(
    model: nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, int | str]:
    """A device map for `model`: GPUs in order first, then the CPU, then the disk, as Accelerate computes it.

    Submodules are placed in order on the current device while they fit; one that does
    not fit is split into its children (unless its class is in `no_split_module_classes`)
    or goes to the next device. The first GPU and the CPU keep room for the largest layer,
    so that an offloaded layer can be brought in to run. Tied weights go with the first
    module that uses them. The model may be on the meta device (`init_empty_weights`).
    `fallback_allocation`: when nothing fits on a device, place there the first remaining
    layer that does fit.
    """
    memory = get_max_memory(max_memory)
    no_split = (
        [no_split_module_classes] if isinstance(no_split_module_classes, str) else list(no_split_module_classes or [])
    )
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    plan = _DevicePlan(model, memory, no_split, sizes, verbose, fallback_allocation)
    device_map = plan.run()
    if clean_result:
        device_map = clean_device_map(device_map)
    if plan.too_small:
        needs = "\n".join(f"  - {device}: {need} bytes required" for device, need in plan.too_small.items())
        logger.info(
            "no module could be assigned to these devices because of insufficient memory (the first module "
            f"considered, plus room for the largest layer where it applies):\n{needs}"
        )
    if not offload_buffers and plan.gpus:
        _warn_if_offloaded_buffers_fit_no_gpu(model, device_map, memory, plan.used, plan.gpus, dtype, special_dtypes)
    return device_map


class _DevicePlan:
    """`infer_auto_device_map` at work: the modules still to place (in order), the device being filled, what
    each device holds, and the largest layer that the main devices keep room for."""

    def __init__(
        self,
        model: nn.Module,
        memory: dict[int | str, int],
        no_split: list[str],
        sizes: dict[str, int],
        verbose: bool,
        fallback_allocation: bool,
    ) -> None:
        self.memory = memory
        self.no_split = no_split
        self.sizes = sizes
        self.verbose = verbose
        self.fallback_allocation = fallback_allocation
        self.devices: list[int | str] = list(memory)
        if "disk" not in self.devices:
            self.devices.append("disk")
        self.gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        self.main_devices = [self.gpus[0], "cpu"] if self.gpus else ["cpu"]
        self.tied = find_tied_parameters(model)
        self.pending: list[tuple[str, Any]] = (
            list(model.named_parameters(recurse=False))
            + list(model.named_children())
            + list(model.named_buffers(recurse=False))
        )
        self.device_map: dict[str, int | str] = {}
        self.used = dict.fromkeys(self.devices, 0)
        self.current = 0
        self.max_layer, self.max_layer_names = get_max_layer_size(self.pending, sizes, no_split)
        self.too_small: dict[int | str, int] = {}  # device -> what the first module it could not take needed

    def run(self) -> dict[str, int | str]:
        """Place every module; the device map."""
        while self.pending:
            name, module = self.pending.pop(0)
            self._say(f"Treating module {name}.")
            self.max_layer_names = [n for n in self.max_layer_names if n != name and not n.startswith(name + ".")]
            if not self.max_layer_names:
                self._find_max_layer()
            self._place(name, module)
        return self.device_map

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)

    def _find_max_layer(self) -> None:
        modules = [(n, m) for n, m in self.pending if isinstance(m, nn.Module)]
        self.max_layer, self.max_layer_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _place(self, name: str, module: Any) -> None:
        """Put `module` on the current device if it fits (with its tied modules); else split it, or a tied module,
        or place a smaller layer first (`fallback_allocation`), or move on to the next device."""
        size = self.sizes[name]
        tied_outside = self._tied_outside(name)
        device = self.devices[self.current]
        limit: int | None = None if device == "disk" else self.memory[device]
        reserved = 0
        if limit is not None and device in self.main_devices:
            limit -= self.max_layer
            reserved = self.max_layer
        size_with_ties, tied_names, tied_modules = get_module_size_with_ties(
            tied_outside, size, self.sizes, self.pending
        )
        if limit is None or self.used[device] + size_with_ties <= limit:
            self._put(name, size, size_with_ties, tied_names, device)
            return
        if (
            tied_outside
            and self.used[device] + size <= limit
            and self._split_tied(name, module, tied_names, tied_modules)
        ):
            return
        if self.used[device] + size >= limit and not _is_leaf_layer(module, self.no_split):
            self._split(name, module)
            return
        if self.used[device] == 0 and self.fallback_allocation and self._fit_first(name, module, size_with_ties):
            return
        self._next_device(name, module, size, size_with_ties, reserved)

    def _tied_outside(self, name: str) -> list[str]:
        """The parameters outside `name` that are tied to one inside it."""
        groups = [
            g for g in self.tied if any(name + "." in k + "." for k in g) and not all(name + "." in k + "." for k in g)
        ]
        return [p for g in groups for p in g if name + "." not in p + "."]

    def _put(self, name: str, size: int, size_with_ties: int, tied_names: list[str], device: int | str) -> None:
        self._say(f"Putting {name} (size={size}) on {device}.")
        self.used[device] += size_with_ties
        self.device_map[name] = device
        for tied_name in tied_names:
            self.pending = [(n, m) for n, m in self.pending if n != tied_name]
            self.device_map[tied_name] = device

    def _split_tied(self, name: str, module: Any, tied_names: list[str], tied_modules: list[Any]) -> bool:
        """Replace the first splittable module tied to `module` by its children, `module` back in front; whether
        there was one."""
        for tied_name, tied_module in zip(tied_names, tied_modules, strict=True):
            if _is_leaf_layer(tied_module, self.no_split):
                continue
            children = list(tied_module.named_parameters(recurse=False)) + list(tied_module.named_children())
            index = next(i for i, (n, _) in enumerate(self.pending) if n == tied_name)
            self.pending = (
                [(name, module)]
                + self.pending[:index]
                + [(f"{tied_name}.{n}", c) for n, c in children]
                + self.pending[index + 1 :]
            )
            self._find_max_layer()
            return True
        return False

    def _split(self, name: str, module: Any) -> None:
        self._say(f"Splitting {name}.")
        children = list(module.named_parameters(recurse=False)) + list(module.named_children())
        self.pending = [(f"{name}.{n}", c) for n, c in children] + self.pending
        self._find_max_layer()

    def _fit_first(self, name: str, module: Any, size_with_ties: int) -> bool:
        """Put in front of `module` the first remaining layer that fits the empty current device; whether one does."""
        device = self.devices[self.current]
        room = self.memory[device] - max(self.max_layer, size_with_ties)
        fallback = _first_fitting_layer(self.pending, self.sizes, room, self.no_split)
        if fallback is None:
            return False
        self.pending = [fallback, (name, module)] + [(n, m) for n, m in self.pending if n != fallback[0]]
        return True

    def _next_device(self, name: str, module: Any, size: int, size_with_ties: int, reserved: int) -> None:
        """Leave the current device (with the room it keeps for the largest layer counted as used) and put
        `module` back in front, for the next device."""
        device = self.devices[self.current]
        self._say(f"Not enough space on {device} for {name} (size {size}): next device.")
        if self.used[device] == 0:
            self.too_small[device] = size_with_ties + reserved
        self.used[device] += reserved
        self.current += 1
        if self.current >= len(self.devices):
            raise RuntimeError(f"infer_auto_device_map: {name} fits on no device of {self.devices}")
        self.pending = [(name, module)] + self.pending


def _warn_if_offloaded_buffers_fit_no_gpu(
    model: nn.Module,
    device_map: dict[str, int | str],
    memory: dict[int | str, int],
    used: dict[int | str, int],
    gpus: list[int | str],
    dtype: str | torch.dtype | None,
    special_dtypes: dict[str, str | torch.dtype] | None,
) -> None:
    """Warn when the buffers of the modules mapped to the CPU or the disk (which stay on the execution device
    unless `offload_buffers`) fit in no GPU's remaining memory."""
    offloaded = [n for n, d in device_map.items() if d in ("cpu", "disk")]
    buffer_size = sum(
        compute_module_total_buffer_size(_get_submodule_or_none(model, n) or nn.Module(), dtype, special_dtypes)
        for n in offloaded
    )
    if buffer_size and not any(memory[g] >= buffer_size + used.get(g, 0) for g in gpus):
        warnings.warn(
            f"the offloaded layers hold {buffer_size} bytes of buffers, which fit in no GPU's remaining memory; "
            "pass offload_buffers=True if you run out of memory",
            stacklevel=3,
        )


def _get_submodule_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        found = model.get_submodule(name) if name else model
    except AttributeError:
        return None
    return found if isinstance(found, nn.Module) else None


def _first_fitting_layer(
    pending: list[tuple[str, Any]], sizes: dict[str, int], room: int, no_split: list[str]
) -> tuple[str, Any] | None:
    queue = list(pending)
    while queue:
        name, module = queue.pop(0)
        if sizes[name] <= room and _is_leaf_layer(module, no_split):
            return name, module
        if not _is_leaf_layer(module, no_split):
            queue.extend((f"{name}.{n}", c) for n, c in module.named_children())
    return None


def check_device_map(model: nn.Module, device_map: dict[str, Any]) -> None:
    """Raise if some tensor of `model`'s state dict is covered by no entry of `device_map`; warn about
    entries that name no submodule."""
    modules = dict(model.named_modules())
    invalid = [key for key in device_map if key != "" and key not in modules]
    if invalid:
        warnings.warn(
            f"The following device_map keys do not match any submodules in the model: {invalid}",
            UserWarning,
            stacklevel=2,
        )
    if "" in device_map:
        return
    keys = list(device_map)
    missing = [n for n in model.state_dict() if not any(n == k or n.startswith(k + ".") for k in keys)]
    if missing:
        raise ValueError(
            f"The device_map provided does not give any device for the following parameters: {', '.join(missing)}"
        )


def load_state_dict(
    checkpoint_file: str | os.PathLike, device_map: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file: safetensors (read onto the CPU) or a `torch.save` pickle (weights only)."""
    path = os.fspath(checkpoint_file)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        with open(path, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            import json

            metadata = json.loads(handle.read(header_size)).get("__metadata__", {})
        if metadata.get("format", "pt") not in ("pt", "np", "tf", "flax", "mlx"):
            raise OSError(f"{path} has format {metadata.get('format')!r} in its metadata; accel reads PyTorch weights")
        return load_file(path, device="cpu")
    from accel.utils.loading import load

    return load(path, map_location="cpu")


def _checkpoint_files(checkpoint: str | os.PathLike) -> list[str]:
    import json

    path = os.fspath(checkpoint)
    if os.path.isfile(path):
        if path.endswith(".json"):
            with open(path) as handle:
                index = json.load(handle)
            weight_map = index.get("weight_map", index)
            folder = os.path.dirname(path)
            return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r} is neither a file nor a folder")
    names = os.listdir(path)
    indexes = [n for n in names if n.endswith(".index.json")]
    if len(indexes) > 1:
        raise ValueError(f"{path} holds several index files {sorted(indexes)}; pass the one to load")
    if indexes:
        return _checkpoint_files(os.path.join(path, indexes[0]))
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".pt", ".pth"))]
    if len(weights) != 1:
        raise ValueError(
            f"{path} should hold one weights file or an index (*.index.json); found {sorted(weights) or 'none'}"
        )
    return [os.path.join(path, weights[0])]


def _device_of(name: str, device_map: dict[str, Any] | None) -> Any:
    if device_map is None:
        return None
    best = None
    for key in device_map:
        covers = key == "" or name == key or name.startswith(key + ".")
        if covers and (best is None or len(key) > len(best)):
            best = key
    if best is None:
        raise ValueError(f"device_map gives no device for {name}")
    return device_map[best]


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: dict[str, Any] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load weights into `model` from a checkpoint.

    `checkpoint` is one weights file (safetensors or pickled), an index
    (`*.index.json`, as `save_model` writes past `max_shard_size`), or a folder holding one
    of those (a `save_model` output).

    Without `device_map`, each file goes through torch's `set_model_state_dict` (so a
    model sharded by FSDP2 or tensor parallelism loads a full checkpoint: `full_state_dict`,
    and `broadcast_from_rank0` where only rank 0 reads the files). With `device_map`
    (which may leave the model on the meta device, `init_empty_weights`), each tensor goes
    to the device its module is mapped to, cast to `dtype` when floating (modules named in
    `keep_in_fp32_modules` stay fp32). Checkpoint keys the model lacks are logged, or with
    `strict=True` an error, as are missing keys. Tied weights are tied again afterwards.
    Modules mapped to "disk" get their weights written to `offload_folder` (Accelerate's
    layout, `accel.utils.offload`) and stay on the meta device; `dispatch_model(...,
    offload_dir=offload_folder)` runs them.
    """
    if offload_8bit_bnb:
        raise ValueError("offload_8bit_bnb is for bitsandbytes 8-bit weights, which accel does not load")
    _make_offload_folder(device_map, offload_folder)
    tied = find_tied_parameters(model)
    model_keys = set(model.state_dict())
    mapped = None
    if device_map is not None:
        mapped = _MappedLoad(model, device_map, dtype, keep_in_fp32_modules, offload_buffers, offload_folder)

    def load(state: dict[str, torch.Tensor]) -> set[str]:
        if mapped is None:
            return _load_through_torch(model, state, dtype, full_state_dict, broadcast_from_rank0)
        return mapped.load(state)

    # with broadcast_from_rank0, rank 0 reads the files (and reports on keys); the others receive
    reads = not broadcast_from_rank0 or not dist.is_initialized() or dist.get_rank() == 0
    loaded, unexpected = _read_checkpoint(_checkpoint_files(checkpoint), model_keys, reads, load)
    if mapped is not None and mapped.offload_index:
        from accel.utils.offload import save_offload_index

        save_offload_index(mapped.offload_index, offload_folder)  # type: ignore[arg-type]
    if reads:
        missing = sorted(model_keys - loaded - {n for g in tied for n in g if any(m in loaded for m in g)})
        _report_keys(model, checkpoint, missing, sorted(unexpected), strict)
    retie_parameters(model, tied)


def _make_offload_folder(device_map: dict[str, Any] | None, offload_folder: str | os.PathLike | None) -> None:
    """Create `offload_folder` when the device map puts modules on "disk" (which needs one)."""
    if device_map is None or "disk" not in [str(v) for v in device_map.values()]:
        return
    if offload_folder is None:
        raise ValueError(
            "device_map puts modules on 'disk': pass offload_folder=..., the folder their weights are written to"
        )
    os.makedirs(os.fspath(offload_folder), exist_ok=True)


def _read_checkpoint(
    files: list[str], model_keys: set[str], reads: bool, load: Callable[[dict[str, torch.Tensor]], set[str]]
) -> tuple[set[str], set[str]]:
    """Hand the model's keys of each file to `load` (which answers the keys it loaded), one file at a time
    (nothing read where `reads` is False); the keys loaded and the checkpoint's keys the model lacks."""
    loaded: set[str] = set()
    unexpected: set[str] = set()
    for file in files:
        state = load_state_dict(file) if reads else {}
        unexpected |= set(state) - model_keys
        wanted = {k: v for k, v in state.items() if k in model_keys}
        del state
        loaded |= load(wanted)
        del wanted  # freed before the next file is read: one file's tensors in memory at a time
    return loaded, unexpected


def _load_through_torch(
    model: nn.Module,
    state: dict[str, Any],
    dtype: str | torch.dtype | None,
    full_state_dict: bool,
    broadcast_from_rank0: bool,
) -> set[str]:
    """Load `state` (the model's own keys) with torch's `set_model_state_dict`, which also fills sharded models;
    the keys of the dict torch was handed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dtype is not None:
        state = {k: v.to(as_dtype(dtype)) if v.is_floating_point() else v for k, v in state.items()}
    options = StateDictOptions(full_state_dict=full_state_dict, strict=False, broadcast_from_rank0=broadcast_from_rank0)
    set_model_state_dict(model, state, options=options)
    # torch adds to the dict it is handed the model's keys it lacked: they count as loaded, as they always have
    return set(state)


class _MappedLoad:
    """Loading along a device map: each tensor goes to its module's device in its loading dtype, or, for a
    module mapped to "disk", into the offload folder (its index kept in `offload_index`)."""

    def __init__(
        self,
        model: nn.Module,
        device_map: dict[str, Any],
        dtype: str | torch.dtype | None,
        keep_in_fp32_modules: list[str] | None,
        offload_buffers: bool,
        offload_folder: str | os.PathLike | None,
    ) -> None:
        self.model = model
        self.device_map = device_map
        self.dtype = dtype
        self.keep_fp32 = list(keep_in_fp32_modules or [])
        self.offload_buffers = offload_buffers
        self.offload_folder = offload_folder
        self.offload_index: dict[str, Any] = {}
        self.parameter_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}

    def load(self, state: dict[str, torch.Tensor]) -> set[str]:
        """Place every tensor of `state` (the model's own keys); their names."""
        for name, value in state.items():
            value_dtype = self._dtype_for(name, value)
            target = _device_of(name, self.device_map)
            if str(target) == "disk" and not self.offload_buffers and name not in self.parameter_names:
                target = "cpu"  # buffers of disk-offloaded modules stay in memory unless offload_buffers
            if str(target) == "disk":
                from accel.utils.offload import offload_weight

                stored = value.to(value_dtype) if value_dtype is not None else value
                offload_weight(stored, name, self.offload_folder, index=self.offload_index)  # type: ignore[arg-type]
                set_module_tensor_to_device(self.model, name, "meta", dtype=value_dtype)
            else:
                set_module_tensor_to_device(self.model, name, target, value=value, dtype=value_dtype)
        return set(state)

    def _dtype_for(self, name: str, value: torch.Tensor) -> torch.dtype | None:
        """The dtype a floating tensor is loaded in: fp32 in the modules kept in fp32, else the one asked for."""
        if not value.is_floating_point():
            return None
        if any(name == m or name.startswith(m + ".") or f".{m}." in f".{name}" for m in self.keep_fp32):
            return torch.float32
        return as_dtype(self.dtype) if self.dtype is not None else None


def _report_keys(
    model: nn.Module, checkpoint: str | os.PathLike, missing: list[str], unexpected: list[str], strict: bool
) -> None:
    """Raise (`strict`) or log about the checkpoint's keys the model lacks and the model's keys it lacks."""
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__}: missing keys {missing}, "
            f"unexpected keys {unexpected} (checkpoint {os.fspath(checkpoint)})"
        )
    if unexpected:
        logger.warning(
            f"Some weights of the model checkpoint at {os.fspath(checkpoint)} were not used when initializing "
            f"{type(model).__name__}: {unexpected}. Check that the checkpoint matches the model definition."
        )
    if missing:
        logger.warning(f"Some weights of {type(model).__name__} were not in {os.fspath(checkpoint)}: {missing}")


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether `module` has an `AlignDevicesHook` that offloads its weights (they live elsewhere between forwards)."""
    from accel.hooks import AlignDevicesHook

    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return False
    hooks = getattr(hook, "hooks", (hook,))
    return any(isinstance(h, AlignDevicesHook) and h.offload for h in hooks)


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: torch.device | str | None = None) -> Iterator[None]:
    """Within the block, the tensors of `module` are on `execution_device` (offloaded ones loaded from their hook)."""
    if has_offloaded_params(module):
        hook: Any = module._hf_hook
        hooks = getattr(hook, "hooks", (hook,))
        offload_hook = next(h for h in hooks if getattr(h, "offload", False))
        saved = offload_hook.execution_device
        if execution_device is not None:
            offload_hook.execution_device = execution_device
        try:
            offload_hook.pre_forward(module)
            yield
        finally:
            offload_hook.post_forward(module, None)
            offload_hook.execution_device = saved
        return
    if execution_device is None:
        yield
        return
    originals = {name: t.device for name, t in named_module_tensors(module)}
    try:
        for name in originals:
            set_module_tensor_to_device(module, name, execution_device)
        yield
    finally:
        for name, device in originals.items():
            set_module_tensor_to_device(module, name, device)


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a model whose weights may be offloaded by hooks, every tensor on the CPU."""
    state: dict[str, torch.Tensor] = {}
    for name, submodule in model.named_modules():
        if not list(named_module_tensors(submodule)):
            continue
        prefix = f"{name}." if name else ""
        with align_module_device(submodule, "cpu"):
            for key, value in named_module_tensors(submodule, remove_non_persistent=True):
                state[prefix + key] = value.detach().cpu()
    return state
