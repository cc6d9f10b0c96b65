"""How tensors get onto a simulated GPU: kernels for the CUDA key, and the few Python entry points.

A factory aimed at a CUDA device (`torch.zeros(..., device="cuda")`, the copy behind
`.to("cuda")`, the gradient buckets DDP allocates in C++) is dispatched by torch to the
CUDA key, where a CPU-only build has no kernel. `install()` registers one Python
kernel there (and on the hidden PrivateUse1 key) that runs the factory on the CPU and
wraps the result, its memory taken first. In Python, the core's entry points
(`accel.sim.core.wrapper.python_entry_points`: `Tensor.to`, `torch.tensor`,
`torch.as_tensor`) and `.cuda` resolve a plain `"cuda"` to the current simulated GPU,
and pinning only marks a copy.

Installed once per simulated GPU rank, never elsewhere: the registrations are process-wide.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.core import wrapper as core_wrapper
from accel.sim.cuda.gpus import shapes as cuda_shapes
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.tensors.cuda_tensor import SimCudaTensor, run_on

aten = torch.ops.aten


def factory_kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run factory `op` aimed at a simulated GPU on the CPU, and wrap what it made (its memory taken first)."""
    device, kwargs = core_wrapper.factory_target(SimCudaTensor, op, kwargs)
    index = device.index or 0
    meta = _on_meta(op, args, kwargs) if cuda_memory.is_counting() or cuda_shapes.enabled() else None
    if meta is not None and not cuda_shapes.keeps_data(meta.untyped_storage().nbytes()):
        out = meta  # shapes only: the tensor is its shape (`accel.sim.cuda.gpus.shapes`)
        cuda_memory.track(out, index, cuda_memory.reserve(index, meta.untyped_storage().nbytes()))
        return SimCudaTensor(out, device)
    reserved = cuda_memory.reserve(index, meta.untyped_storage().nbytes()) if meta is not None else None
    try:
        out = run_on(device, op, args, kwargs)
    except BaseException:
        cuda_memory.unreserve(index, reserved)
        raise
    if isinstance(out, torch.Tensor):
        cuda_memory.track(out, index, reserved)
        return SimCudaTensor(out, device)
    return type(out)(SimCudaTensor(t, device) for t in out)


def _on_meta(op: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """What `op` will make, made on the meta device (which allocates nothing): its size, before the host's.

    None when there is no meta kernel, or arguments only the CPU kernel reads: the memory
    is then counted (and out-of-memory raised) just after the host made the tensor.
    """
    try:
        meta = op(*args, **dict(kwargs, device=torch.device("meta")))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    if not isinstance(meta, torch.Tensor) or meta.layout is not torch.strided:
        return None
    return meta


# -- Python entry points ---------------------------------------------------------------------------

#: the core's entry points for simulated GPUs, once installed (`Tensor.to`, `torch.tensor`, `torch.as_tensor`)
_points: dict[str, Any] = {}


def tensor_cuda(
    self: torch.Tensor, device: Any = None, non_blocking: bool = False, memory_format: Any = torch.preserve_format
) -> torch.Tensor:
    """`Tensor.cuda`: a copy on the given (default: current) simulated GPU, or `self` if already there."""
    target = cuda_state.gpus().resolve("cuda" if device is None else device)
    return _points["to"](self, target, non_blocking=non_blocking, memory_format=memory_format)


def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    """`Tensor.pin_memory`: a copy in "pinned" host memory, as on a GPU host (itself if already pinned).

    A simulated GPU reads host memory directly, so nothing is page-locked: the copy's
    storage is only marked, so that `is_pinned()` answers as on a GPU host.
    """
    if type(self) is SimCudaTensor:
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    if is_pinned(self):
        return self
    out = self.clone()
    out.untyped_storage()._accel_pinned = True  # type: ignore[attr-defined]  # storages keep one Python object
    return out


def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    """`Tensor.is_pinned`: true for what `pin_memory()` gave (C++ is told all host memory is, see `torch_internals`)."""
    return type(self) is not SimCudaTensor and getattr(self.untyped_storage(), "_accel_pinned", False)


def install() -> None:
    """Register the kernels and patch the Python entry points (once per process)."""
    if _points:
        return
    core_wrapper.register_factories(("CUDA", "PrivateUse1"), factory_kernel)
    _points.update(core_wrapper.install_entry_points(SimCudaTensor))
    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign,assignment]  # same signature
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign,assignment]  # same signature
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign,assignment]  # same signature
