"""How long one kernel takes on the simulated card: its FLOPs against the card's peak for its dtype, or
the bytes it moves against the card's memory bandwidth, whichever is longer.

FLOPs are torch's own count (`torch.utils.flop_counter.flop_registry`: matmuls, convolutions, the
attention kernels); every other op is memory-bound: it reads its tensor arguments and writes its
results. Each kind of kernel reaches only part of the datasheet peak (`EFFICIENCY`), and a matmul
whose tiles do not fill the card's SMs reaches less (the last wave of tiles runs part-empty). Ops that
launch no kernel (views, `empty`, metadata) cost nothing and are not launched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from accel.sim.cuda.gpus.cards import GpuModel

aten = torch.ops.aten

#: the share of the datasheet's dense peak each kind of kernel reaches on a large problem, from published
#: microbenchmarks (docs/planning.md): cuBLAS BF16 GEMMs 80% on H100 SXM, 87% on A100 SXM, FP8 71% on H100;
#: large HBM copies ~85%; attention by backend below (`ATTENTION`)
EFFICIENCY = {"matmul": 0.8, "matmul_fp8": 0.71, "conv": 0.6, "memory": 0.85}
#: attention kernels' share of the peak: (backend, Hopper or later) -> (forward, backward). FlashAttention-2 (torch's
#: flash backend) reaches ~35% of an H100's peak forward and ~32% backward, 50-73% on an A100 (FA2 paper); cuDNN's
#: attention ~60% / 52% on H100 (FA3 paper's figures of cuDNN); the memory-efficient kernel less than flash
ATTENTION = {
    ("flash", True): (0.36, 0.32), ("flash", False): (0.65, 0.55),
    ("cudnn", True): (0.6, 0.52), ("cudnn", False): (0.55, 0.45),
    ("efficient", True): (0.25, 0.2), ("efficient", False): (0.45, 0.35),
}  # fmt: skip
_MEMORY_SHARE = 1e12 * EFFICIENCY["memory"]
#: the shortest a kernel takes on the GPU, however small (launch latency on the device, a few microseconds)
MIN_KERNEL_S = 2.5e-6
#: the output tile of a tensor-core GEMM kernel (cuBLAS' common 128 x 128 / 128 x 256 tiles on Ampere/Hopper)
TILE = 128

#: ops that launch no kernel: allocations and metadata (views are known by `func.is_view`)
_NO_KERNEL = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.detach.default, aten.lift_fresh.default, aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.resize_.default,
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.sym_size.int, aten.sym_stride.int,
    aten.sym_numel.default, aten.sym_storage_offset.default, aten.record_stream.default,
    aten._unsafe_view.default,  # a view whose schema says it is not (autograd's sake): it launches no kernel
}  # fmt: skip
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
_CONVS = {aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_backward}
#: namespaces of ops that stand for collectives: the process group times those (`timing.ops.collective`)
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d", "_dtensor"}


_flop_registry: list[dict] = []


def _flop_formulas() -> dict:
    """torch's table of FLOP formulas, imported at the first op timed: `torch.utils.flop_counter` imports Triton,
    0.2 s that every simulated process (PyTorch's tests spawn one per rank per test) would pay at start."""
    if not _flop_registry:
        from torch.utils.flop_counter import flop_registry

        _flop_registry.append(flop_registry)
    return _flop_registry[0]


def kind_of(func: Any) -> str | None:
    """What kind of kernel op `func` launches: "matmul", "conv", "memory", or an attention backend's
    ("flash", "efficient", "cudnn", with "_backward" for its backward); None when it launches none."""
    if func.is_view or func in _NO_KERNEL or func.namespace in _COLLECTIVE_NAMESPACES:
        return None
    packet = func._overloadpacket
    if packet not in _flop_formulas():
        return "memory"
    if packet in _MATMULS:
        return "matmul"
    if packet in _CONVS:
        return "conv"
    name = func.name()
    backend = "flash" if "flash" in name else "cudnn" if "cudnn" in name else "efficient"
    return backend + ("_backward" if "backward" in name else "")


def math_kind(dtype: torch.dtype) -> str:
    """Which of the card's peaks a matmul of `dtype` runs at ("bf16", "tf32", "fp8", ...)."""
    if dtype in (torch.bfloat16,):
        return "bf16"
    if dtype in (torch.float16,):
        return "fp16"
    if dtype == torch.float32:
        # FP32 matmuls use TF32 tensor cores when torch allows them (`allow_tf32`, precision "high")
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    if dtype == torch.float64:
        return "fp64"
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return "fp8"
    return "fp32"


def nbytes(value: Any) -> int:
    """Bytes of the tensors in `value` (a tensor, or a list or tuple of them, one level deep)."""
    if isinstance(value, Tensor):
        return value.nbytes
    if type(value) is list or type(value) is tuple:
        return sum(v.nbytes for v in value if isinstance(v, Tensor))
    return 0


def moved_bytes(args: Any, out: Any) -> int:
    """What a memory-bound kernel reads and writes: its tensor arguments and its results (every op comes here:
    kept short)."""
    total = 0
    for value in args:
        if isinstance(value, Tensor):
            total += value.nbytes
        elif (type(value) is list or type(value) is tuple) and value:
            total += nbytes(value)
    return total + (out.nbytes if isinstance(out, Tensor) else nbytes(out))


def flops(func: Any, args: Any, kwargs: dict, out: Any) -> int:
    """torch's FLOP count of one call of `func` (0 for ops torch counts none for)."""
    formula = _flop_formulas().get(func._overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _first_dtype(args: Any) -> torch.dtype:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.dtype
    return torch.float32


def _tile_use(out: Any, sms: int) -> float:
    """The share of the SMs a GEMM's output tiles keep busy over its waves (1: every wave full)."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return 1.0
    rows, cols = out.shape[-2], out.shape[-1]
    tiles = math.ceil(rows / TILE) * math.ceil(cols / TILE) * max(1, out.numel() // max(1, rows * cols))
    waves = math.ceil(tiles / sms)
    return tiles / (waves * sms) if waves else 1.0


def _efficiency(card: GpuModel, kind: str, dtype: torch.dtype, out: Any) -> float:
    if kind == "matmul":
        base = EFFICIENCY["matmul_fp8" if dtype.itemsize == 1 else "matmul"]
        return base * _tile_use(out, card.multi_processor_count)
    if kind == "conv":
        return EFFICIENCY["conv"]
    backend, _, backward = kind.partition("_")
    forward_share, backward_share = ATTENTION[(backend, card.major >= 9)]
    return backward_share if backward else forward_share


def duration(card: GpuModel, func: Any, kind: str, args: Any, kwargs: dict, out: Any) -> tuple[float, int]:
    """(seconds, FLOPs) of one kernel of `func` on `card`, whose arguments and result are given."""
    speeds = card.speeds
    memory_s = moved(card, moved_bytes(args, out))
    if kind == "memory":
        return memory_s, 0
    work = flops(func, args, kwargs, out)
    dtype = _first_dtype(args)
    peak = speeds.peak(math_kind(dtype))
    return max(MIN_KERNEL_S, work / (peak * _efficiency(card, kind, dtype, out)), memory_s), work


def moved(card: GpuModel, count: int) -> float:
    """Seconds of a memory-bound kernel that reads and writes `count` bytes in all."""
    seconds = count / (card.speeds.memory_tbps * _MEMORY_SHARE)
    return seconds if seconds > MIN_KERNEL_S else MIN_KERNEL_S


def transfer(card: GpuModel, nbytes: int) -> float:
    """Seconds of a copy of `nbytes` between the host and the GPU (over PCIe, from pinned or pageable memory)."""
    return max(MIN_KERNEL_S, nbytes / (card.speeds.pcie_gbps * 1e9 * EFFICIENCY["memory"]))
