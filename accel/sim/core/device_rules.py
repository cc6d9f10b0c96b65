"""Which devices an op accepts together, and the error the real device gives when they differ.

Shared by the simulated devices. The walk over an op's tensor arguments is common: all
tensor arguments on one device, except that a 0-dim CPU tensor may join device tensors
(it is read as a scalar), copies cross devices, and indexing accepts CPU index tensors.
What a mismatch raises is the device's own: `common_device(..., mismatch=...)` calls the
device's function. CUDA's (`mismatch_error`, the default) has two messages, and the
simulator gives the one the same op gives on a GPU: pointwise ops (TensorIterator) say
"found at least two devices, cuda:0 and cpu!", the other ops check argument by argument
and name the first one on another device. XLA's words are in `accel.sim.xla.rules`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from accel.sim.core import torch_internals

#: c10's names of dtypes ("Float", "BFloat16"): what ATen's type names and "not implemented for" errors print
SCALAR_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}

aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            found.append(op)
    return frozenset(found)


#: ops that move data between devices: any mix is fine
CROSS_DEVICE_OPS = _ops(
    "copy_.default",
    "_to_copy.default",
    "_copy_from.default",
    "_copy_from_and_resize.default",
    "set_.source_Tensor",
    "record_stream.default",
    "_has_same_storage_numel.default",
    "is_set_to.default",
    "_foreach_copy_.default",
)
#: ops whose second argument is a list of indices, which may be on the CPU
INDEX_OPS = _ops(
    "index.Tensor",
    "index_put_.default",
    "index_put.default",
    "_index_put_impl_.default",
    "_unsafe_index.Tensor",
    "_unsafe_index_put.default",
)
_POINTWISE = torch.Tag.pointwise

#: ops whose CUDA kernel is a composite: the device check a GPU runs is that of the op they
#: call, with its own argument names (op -> (inner op, {our argument: its argument}))
_COMPOSITES = {
    "aten::stack": ("aten::cat", "", {"tensors": "tensors"}),
    "aten::embedding": ("aten::index_select", "", {"indices": "index", "weight": "self"}),
}


@functools.cache
def _native_functions() -> str:
    path = torch_internals.native_functions_yaml()
    if path is None:
        return ""
    with open(path) as declarations:
        return declarations.read()


@functools.cache
def _kernel_facts(name: str, overload: str) -> tuple[bool, bool] | None:
    """(checks devices with TensorIterator, is a structured kernel) as torch declares the op; None if unknown."""
    text = _native_functions()
    head = f"\n- func: {name}{'.' + overload if overload else ''}("
    start = text.find(head)
    if start < 0:
        return None
    end = text.find("\n- func:", start + len(head))
    block = text[start : end if end >= 0 else len(text)]
    return "device_check: NoCheck" in block, "structured_delegate:" in block or "structured: True" in block


def mismatch_error(func: Any, args: tuple, kwargs: dict, common: torch.device, other: torch.device) -> RuntimeError:
    """The RuntimeError a CUDA build raises when `func` gets tensors on `common` and `other`."""
    schema = func._schema
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
    argument = "?"
    for spec, value in zip(schema.arguments, values, strict=False):
        tensors = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(t, torch.Tensor) and t.device == other for t in tensors):
            argument = spec.name
            break
    name, overload = schema.name, schema.overload_name
    if name in _COMPOSITES:
        name, overload, renames = _COMPOSITES[name]
        argument = renames.get(argument, argument)
    base = name.split("::")[-1]
    facts = _kernel_facts(base, overload)
    if facts is None:  # not in torch's declarations: decide from the op's tags
        facts = (_POINTWISE in func.tags or base.startswith("_foreach"), True)
    iterator_checked, structured = facts
    if iterator_checked:
        return RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {common} and {other}!"
        )
    # The code generated for a CUDA kernel checks argument by argument and names the
    # first one on another device, and the kernel's wrapper function.
    unambiguous = f"{base}_{overload}" if overload else base
    method = f"wrapper_CUDA_{unambiguous}" if structured else f"wrapper_CUDA_{overload}_{unambiguous}"
    return RuntimeError(
        f"Expected all tensors to be on the same device, but got {argument} is on {other}, "
        f"different from other tensors on {common} (when checking argument in method {method})"
    )


#: what a device raises when `func` gets tensors on `common` and `other`: f(func, args, kwargs, common, other)
Mismatch = Callable[[Any, tuple, dict, torch.device, torch.device], BaseException]


def common_device(func: Any, args: tuple, kwargs: dict, mismatch: Mismatch | None = None) -> torch.device | None:
    """The device `func` computes on, given its arguments; raises `mismatch(...)` (default: CUDA's) on a mismatch.

    None when no argument is a tensor.
    """
    if func in CROSS_DEVICE_OPS:
        return None
    common: torch.device | None = None
    common_is_cpu_scalar = False
    skip_indices = func in INDEX_OPS

    def visit(tensor: torch.Tensor) -> None:
        nonlocal common, common_is_cpu_scalar
        device = tensor.device
        cpu_scalar = device.type == "cpu" and tensor.dim() == 0
        if common is None:
            common, common_is_cpu_scalar = device, cpu_scalar
        elif device == common:
            common_is_cpu_scalar = common_is_cpu_scalar and cpu_scalar
        elif cpu_scalar:
            return
        elif common_is_cpu_scalar:
            common, common_is_cpu_scalar = device, False
        else:
            raise (mismatch or mismatch_error)(func, args, kwargs, common, device)

    if skip_indices:
        _check_indices(args, kwargs)
    for position, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            visit(value)
        elif isinstance(value, (list, tuple)) and not (skip_indices and position == 1):
            for item in value:
                if isinstance(item, torch.Tensor):
                    visit(item)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            visit(value)
        elif isinstance(value, (list, tuple)) and not (skip_indices and name == "indices"):
            for item in value:
                if isinstance(item, torch.Tensor):
                    visit(item)
    return common


def _check_indices(args: tuple, kwargs: dict) -> None:
    """Indices may be on the CPU or on the indexed tensor's device (ATen's check, the words a real GPU gave)."""
    indexed = args[0] if args else kwargs.get("self")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    if not isinstance(indexed, torch.Tensor) or not isinstance(indices, (list, tuple)):
        return
    for index in indices:
        if isinstance(index, torch.Tensor) and index.device.type != "cpu" and index.device != indexed.device:
            raise RuntimeError(
                f"indices should be either on cpu or on the same device as the indexed tensor ({indexed.device})"
            )
