"""Finding the user's model inside the wrappers that training adds around it.

`prepare()` may put a model inside `DistributedDataParallel` (or another wrapper with a
`.module`), and users may hand it a `torch.compile`d model; saving, loading and
inspecting want the plain `nn.Module` back.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


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
