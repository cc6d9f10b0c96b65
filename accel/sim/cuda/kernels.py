"""How tensors get onto a simulated GPU: kernels for the CUDA key, and the few Python entry points.

A factory aimed at a CUDA device (`torch.zeros(..., device="cuda")`, the copy behind
`.to("cuda")`, the gradient buckets DDP allocates in C++) is dispatched by torch to the
CUDA key, where a CPU-only build has no kernel. `install()` registers one Python
kernel there (and on the hidden PrivateUse1 key) that runs the factory on the CPU and
wraps the result. In Python, `Tensor.to` / `.cuda` resolve a plain `"cuda"` to the
current simulated GPU, `torch.tensor` / `torch.as_tensor` build on the CPU and then
wrap (simpler and safer than giving C++ a CUDA device guard), and pinning is a no-op.

Installed once per simulated GPU rank, never elsewhere: the registrations are process-wide.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.core import wrapper as core_wrapper
from accel.sim.cuda import memory as cuda_memory
from accel.sim.cuda import shapes as cuda_shapes
from accel.sim.cuda import state as cuda_state
from accel.sim.cuda.tensor import SimCudaTensor, run_on, unwrap

aten = torch.ops.aten

_CUDA_TYPES = ("cuda", cuda_state.HIDDEN_DEVICE)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith(_CUDA_TYPES)
    return isinstance(device, torch.device) and device.type in _CUDA_TYPES


def factory_kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run factory `op` aimed at a simulated GPU on the CPU, and wrap what it made."""
    device = kwargs.get("device")
    if device is None or not _is_cuda(device):
        raise NotImplementedError(
            f"{op} reached the simulated GPU without a CUDA device argument; the simulator has no kernel for it "
            "(please report this with the code that called it)"
        )
    device = cuda_state.gpus().resolve(device)
    kwargs = dict(kwargs, device=torch.device("cpu"))
    kwargs.pop("pin_memory", None)
    index = device.index or 0
    meta = _on_meta(op, args, kwargs) if cuda_memory.is_counting() or cuda_shapes.enabled() else None
    if meta is not None and not cuda_shapes.keeps_data(meta.untyped_storage().nbytes()):
        out = meta  # shapes only: the tensor is its shape (`accel.sim.cuda.shapes`)
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


def _register_kernels() -> None:
    # The core's registration (every factory, and copy_, on both keys), with this module's kernel.
    core_wrapper.register_factories(("CUDA", "PrivateUse1"), factory_kernel)


# -- Python entry points ---------------------------------------------------------------------------

_originals: dict[str, Any] = {}


def _resolve(device: Any) -> Any:
    if _is_cuda(device) or (isinstance(device, int) and not isinstance(device, bool)):
        return cuda_state.gpus().resolve(device)
    return device


def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`Tensor.to`, with `"cuda"` meaning the current simulated GPU and `self` returned when nothing changes."""
    if args and (_is_cuda(args[0]) or (isinstance(args[0], int) and not isinstance(args[0], bool))):
        args = (_resolve(args[0]), *args[1:])
    if kwargs.get("device") is not None:
        kwargs["device"] = _resolve(kwargs["device"])
    if type(self) is SimCudaTensor and not kwargs.get("copy", False):
        # C++ would compare its hidden device with cuda:k and always copy.
        device, dtype, _, memory_format = torch_internals.parse_to(*args, **kwargs)
        same_device = device is None or device == self._shown
        same_dtype = dtype is None or dtype == self.dtype
        same_format = memory_format is None or memory_format == torch.preserve_format
        if same_device and same_dtype and same_format and (device is not None or dtype is not None):
            return self
    return _originals["to"](self, *args, **kwargs)


def tensor_cuda(
    self: torch.Tensor, device: Any = None, non_blocking: bool = False, memory_format: Any = torch.preserve_format
) -> torch.Tensor:
    """`Tensor.cuda`: a copy on the given (default: current) simulated GPU, or `self` if already there."""
    target = cuda_state.gpus().resolve("cuda" if device is None else device)
    return tensor_to(self, target, non_blocking=non_blocking, memory_format=memory_format)


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


def tensor(
    data: Any, *, dtype: Any = None, device: Any = None, requires_grad: bool = False, pin_memory: bool = False
) -> torch.Tensor:
    """`torch.tensor`: on a simulated GPU, built on the CPU and then wrapped."""
    if isinstance(data, SimCudaTensor) and device is None:
        device = data.device
    if device is None or not _is_cuda(device):
        out = _originals["tensor"](unwrap(data) if isinstance(data, torch.Tensor) else data, dtype=dtype, device=device)
        return out.requires_grad_(requires_grad) if requires_grad else out
    target = cuda_state.gpus().resolve(device)
    inner = _originals["tensor"](unwrap(data) if isinstance(data, torch.Tensor) else data, dtype=dtype)
    out = SimCudaTensor(inner, target)
    return out.requires_grad_(requires_grad) if requires_grad else out


def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
    """`torch.as_tensor`: no copy where none is needed, a copy onto a simulated GPU otherwise."""
    if isinstance(data, torch.Tensor):
        return tensor_to(data, device=device, dtype=dtype) if (device is not None or dtype is not None) else data
    if device is None or not _is_cuda(device):
        return _originals["as_tensor"](data, dtype=dtype, device=device)
    return SimCudaTensor(_originals["as_tensor"](data, dtype=dtype), cuda_state.gpus().resolve(device))


def install() -> None:
    """Register the kernels and patch the Python entry points (once per process)."""
    if _originals:
        return
    _register_kernels()
    _originals.update(to=torch.Tensor.to, tensor=torch.tensor, as_tensor=torch.as_tensor)
    torch.Tensor.to = tensor_to  # type: ignore[method-assign,assignment]  # same signature
    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign,assignment]  # same signature
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign,assignment]  # same signature
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign,assignment]  # same signature
    torch.tensor = tensor  # type: ignore[assignment]  # same signature
    torch.as_tensor = as_tensor
