"""cuBLAS workspaces: memory a GPU process holds from its first matrix product on.

On a GPU, torch hands each (cuBLAS handle, stream) pair a workspace from the caching
allocator the first time that pair runs a cuBLAS op, and keeps it for the life of the
process; an op that goes through cuBLASLt (a matrix product with a bias, `addmm`) also
takes a cuBLASLt workspace for the pair. Handles belong to threads: the forward runs on
the caller's thread and the backward on the autograd engine's thread of that GPU, so a
training step holds two of each. On a real H200 (torch 2.11) the first training step of
an MLP allocated exactly 32 MiB + 1 MiB more than its tensors: these.

Sizes as torch chooses them: `CUBLAS_WORKSPACE_CONFIG` (":SIZE:COUNT" pairs, KiB) or by
default 32 MiB on sm_90 and 2 x 4 MiB + 8 x 16 KiB elsewhere; `CUBLASLT_WORKSPACE_SIZE`
(KiB, default 1024, at most the cuBLAS one's), none of its own when
`TORCH_CUBLASLT_UNIFIED_WORKSPACE` is set true (each rule checked on a real H200).
A simulated GPU has one stream, and its backward runs on the caller's thread: the pair is
told apart by whether the autograd engine is running (`torch_internals.in_backward`).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.memory.allocator import Block, DeviceMemory

KiB = 1024
aten = torch.ops.aten

#: ops that take a cuBLAS handle (and so its workspace) on a GPU
CUBLAS_OPS = frozenset(
    op.default
    for op in (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.addmv, aten.mv, aten.dot, aten.vdot)
)

#: (device index, in backward, "blas" | "lt") -> (the allocator the block is in, the block)
_workspaces: dict[tuple[int, bool, str], tuple[DeviceMemory, Block | None]] = {}


def cublas_size(capability: tuple[int, int], env: dict[str, str] | os._Environ = os.environ) -> int:
    """Bytes of one cuBLAS workspace on a card of `capability`."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    default = 4096 * 8 * KiB if capability == (9, 0) else 4096 * KiB * 2 + 16 * KiB * 8
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default  # torch warns and takes its default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def cublaslt_size(cublas: int, env: dict[str, str] | os._Environ = os.environ) -> int:
    """Bytes of one cuBLASLt workspace beside a cuBLAS one of `cublas` bytes (0: it shares that one).

    As torch 2.11 does on a real H200: shared only when `TORCH_CUBLASLT_UNIFIED_WORKSPACE` says
    true; unset, it is a workspace of its own but no larger than the cuBLAS one.
    """
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    flag = None if unified is None else unified.strip().lower()
    if flag in _TRUE:
        return 0
    value = env.get("CUBLASLT_WORKSPACE_SIZE")
    try:
        size = int(value) * KiB if value is not None else 1024 * KiB
    except ValueError:
        size = 1024 * KiB  # torch warns and takes its default
    return size if flag in _FALSE else min(size, cublas)


_TRUE = ("1", "y", "yes", "true", "on")
_FALSE = ("0", "n", "no", "false", "off")


def uses_cublaslt(func: object, args: tuple) -> bool:
    """Whether `addmm` goes through cuBLASLt on a GPU: a 1-D contiguous bias over 2-D factors
    whose second is at least 2 x 2 (torch's condition for the fused bias epilogue)."""
    if func is not aten.addmm.default or len(args) < 3:
        return False
    bias, first, second = args[0], args[1], args[2]
    return (
        bias.dim() == 1
        and bias.is_contiguous()
        and first.dim() == 2
        and second.dim() == 2
        and second.shape[0] > 1
        and second.shape[1] > 1
        and bias.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    )


def ensure(index: int, lt: bool) -> None:
    """Before a cuBLAS op on simulated GPU `index`: its workspaces, allocated the first time."""
    if not cuda_memory.is_counting():
        return
    memory = cuda_memory.device(index)
    backward = torch_internals.in_backward()
    memory.note_outside("cublas", memory.model.cublas_memory)  # the library's own, at its first use
    cublas = cublas_size((memory.model.major, memory.model.minor))
    _take((index, backward, "blas"), memory, cublas)
    if lt:
        size = cublaslt_size(cublas)
        if size:
            _take((index, backward, "lt"), memory, size)


def handlers() -> dict[Any, Any]:
    """The cuBLAS ops -> handlers that take the workspaces once the op's device is known (`cuda_tensor.add_special`)."""
    return {op: functools.partial(_run, op) for op in CUBLAS_OPS}


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    from accel.sim.cuda.tensors import cuda_tensor

    device = cuda_tensor.op_device(func, args, kwargs)  # a device mismatch fails first, as on a GPU
    inner = getattr(args[0], "_inner", None) if args else None
    traced = inner is not None and torch_internals.is_fake(inner)
    if device is not None and device.type == "cuda" and not traced:  # tracing (torch.export) calls no cuBLAS
        ensure(device.index or 0, uses_cublaslt(func, args))
    return cuda_tensor.dispatch(func, args, kwargs, apart=False)


def _take(key: tuple[int, bool, str], memory: DeviceMemory, size: int) -> None:
    held = _workspaces.get(key)
    if held is not None and held[0] is memory:
        return  # the same allocator (a new one means the GPUs were set up anew: the old block is gone)
    _workspaces[key] = (memory, cuda_memory.reserve(key[0], size))


def clear() -> None:
    """Give every workspace back (`torch._C._cuda_clearCublasWorkspaces`, and a GPU set up anew)."""
    for memory, block in _workspaces.values():
        if block is not None and any(memory is current for current in cuda_memory.counting_list()):
            memory.free(block)
    _workspaces.clear()
