"""The fused attention kernels on a simulated GPU: results computed on the host, memory taken as on the card.

Each handler stands for one CUDA op of torch 2.13 (`_scaled_dot_product_{flash,efficient,
cudnn}_attention` and their backwards). Its numbers come from the CPU's flash kernel (or,
with dropout, from attention written out on the host with a mask drawn from the GPU's
generator and redrawn in the backward from the seed kept in the op's RNG outputs); its
memory is what the CUDA op allocates, in the order it allocates it: the outputs, with the
layouts the kernels give them, and the buffers that live only while the kernel runs.

What each allocates (read off flash_api.cpp, attention.cu, attention_backward.cu and the
memory-efficient kernels' headers):

* flash forward: the output (`empty_like` the query, so its layout), the logsumexp
  (B, H, L) fp32, a 16-byte RNG state and an 8-byte spare; split-KV scratch when the
  work cannot fill the card (`num_splits_heuristic`): (splits, B, H, L) and
  (splits, B, H, L, D rounded) fp32.
* flash backward: copies of grad_out and out unless their (B, L, H, D) views are
  contiguous, dq/dk/dv (`empty_like`), softmax_d (B, H, L rounded to 128) fp32, the dq
  accumulator (B, L rounded, H, D rounded) fp32 (one per split under deterministic
  algorithms), and for grouped-query attention dk/dv of all query heads, summed after.
* memory-efficient forward: the output in (B, L, H, Dv) layout, the logsumexp (B, H, L
  rounded to 32) fp32 when gradients are wanted, and for head dims above 128 in 16-bit
  types an fp32 output accumulator; its RNG seed and offset are host tensors.
* memory-efficient backward: a contiguous grad_out, dq/dk/dv in (B, L, H, D) layout, the
  bias gradient (last dim padded to 16), delta (B, H, L) fp32 and the kernel's workspace
  (`workspace_size()` of the kernel `dispatch_cutlassB` picks).
* cuDNN forward: the output in the query's layout, softmax stats (B, H, L, 1) fp32 when
  gradients are wanted; backward: dq/dk/dv (`empty_like`; cuDNN 9.5.1 and newer take a
  grad_out of any strides as it is). cuDNN's own workspace, sized by its engine heuristics
  at run time, is not counted (no rule for it outside the library).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from accel.sim.cuda.gpus import generators
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.tensors.cuda_tensor import SIM, host_tensors, wrap_like

aten = torch.ops.aten
_FP32 = torch.float32


# -- allocating as a kernel does ---------------------------------------------------------------------------


class _Kernel:
    """The allocations of one CUDA op on the simulated GPU of `like`: outputs kept, scratch freed at the end."""

    def __init__(self, like: torch.Tensor) -> None:
        self.like = like
        self.index = like.device.index or 0
        self.scratch_blocks: list[Any] = []

    def output(self, host: torch.Tensor) -> torch.Tensor:
        """`host` as a tensor of the simulated GPU (its memory taken now)."""
        return wrap_like(host, self.like)

    def scratch(self, *sizes: int) -> list[Any]:
        """Buffers of these many bytes, each allocated apart, that the op holds until it returns (or `free`)."""
        blocks = []
        for nbytes in sizes:
            if cuda_memory.is_counting() and nbytes > 0:
                blocks.append(cuda_memory.reserve(self.index, nbytes))
        self.scratch_blocks.extend(blocks)
        return blocks

    def free(self, blocks: list[Any]) -> None:
        """Give back scratch buffers before the op returns."""
        for block in blocks:
            self.scratch_blocks.remove(block)
            cuda_memory.unreserve(self.index, block)


@contextlib.contextmanager
def _kernel(like: torch.Tensor) -> Iterator[_Kernel]:
    kernel = _Kernel(like)
    try:
        yield kernel
    finally:
        for block in kernel.scratch_blocks:
            cuda_memory.unreserve(kernel.index, block)


def _nbytes(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _filled(layout: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A host tensor laid out as `layout` (`empty_like`: its strides when dense) holding `values`."""
    out = torch.empty_like(layout)
    return out if out.is_meta else out.copy_(values)


def _in_layout(order_of: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` in a new tensor whose dims are ordered in memory as `order_of`'s (`alloc_with_matching_layout`)."""
    order = sorted(range(order_of.dim()), key=lambda d: order_of.stride(d), reverse=True)
    shape = [values.shape[d] for d in order]
    out = torch.empty(shape, dtype=values.dtype, device=values.device).permute(*_inverse(order))
    return out if values.is_meta else out.copy_(values)


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def _bshd(values: torch.Tensor) -> torch.Tensor:
    """`values` (B, H, L, D) in a new tensor laid out as (B, L, H, D), seen as (B, H, L, D)."""
    b, h, length, d = values.shape
    out = torch.empty((b, length, h, d), dtype=values.dtype, device=values.device).transpose(1, 2)
    return out if values.is_meta else out.copy_(values)


def _contiguous_copy_bytes(t: torch.Tensor) -> int:
    """Bytes `.contiguous()` allocates for `t` (none when it is contiguous already)."""
    return 0 if t.is_contiguous() else t.numel() * t.element_size()


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    # TORCH_WARN_ONCE: once per process
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, UserWarning, stacklevel=4)


def _deterministic() -> bool:
    """Whether kernels must run deterministically (warn-only mode warns instead)."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


# -- the numbers, on the host ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Attention:
    """One attention, on host tensors: what the forward computes and the backward recomputes from."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    bias: torch.Tensor | None
    is_causal: bool
    scale: float | None
    dropout_p: float = 0.0
    seed: int = 0

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, logsumexp (B, H, L) fp32)."""
        q, k, v = self.query, self.key, self.value
        if q.is_meta:
            b, h, length = q.shape[:3]
            out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device="meta")
            return out, torch.empty((b, h, length), dtype=_FP32, device="meta")
        if self.dropout_p > 0.0:
            weights, lse = self._weights()
            return ((weights * self._kept(weights.shape)) @ self._grouped(v)).to(q.dtype), lse
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, self.is_causal, attn_mask=self.bias, scale=self.scale
        )

    def backward(
        self, grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, bias_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(dq, dk, dv, dbias or None) from the output's gradient and the forward's output and logsumexp."""
        q, k, v = self.query, self.key, self.value
        if q.is_meta:
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None
        if self.dropout_p > 0.0 or bias_grad:
            return self._written_out_backward(grad, bias_grad)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad, q, k, v, out, lse, 0.0, self.is_causal, attn_mask=self.bias, scale=self.scale
        )
        return dq, dk, dv, None

    # Dropout and bias gradients, which the CPU kernel has not, are written out in fp32 (autograd is off
    # inside a tensor's dispatch): P = softmax(scale q k^T + bias), out = (P * kept) v.

    @property
    def _scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.query.shape[-1])

    def _grouped(self, t: torch.Tensor) -> torch.Tensor:
        """Key or value heads repeated for each query head of their group, in fp32."""
        return t.float().repeat_interleave(self.query.shape[1] // t.shape[1], dim=1)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (self.query.float() @ self._grouped(self.key).transpose(-2, -1)) * self._scale
        if self.bias is not None:
            scores = scores + self.bias.float()
        if self.is_causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1), torch.logsumexp(scores, dim=-1)

    def _kept(self, shape: torch.Size) -> torch.Tensor:
        """The dropout mask the seed draws (the same in forward and backward), scaled by 1 / (1 - p)."""
        if self.dropout_p == 0.0:
            return torch.ones(())
        drawn = torch.rand(shape, generator=torch.Generator().manual_seed(self.seed))
        return (drawn >= self.dropout_p).float() / (1.0 - self.dropout_p)

    def _written_out_backward(self, grad: torch.Tensor, bias_grad: bool) -> Any:
        weights, _ = self._weights()
        kept = self._kept(weights.shape)
        grad = grad.float()
        d_value = (weights * kept).transpose(-2, -1) @ grad
        d_weights = (grad @ self._grouped(self.value).transpose(-2, -1)) * kept
        d_scores = weights * (d_weights - (d_weights * weights).sum(-1, keepdim=True))
        d_query = (d_scores @ self._grouped(self.key)) * self._scale
        d_key = (d_scores.transpose(-2, -1) @ self.query.float()) * self._scale
        grads = [d_query.to(self.query.dtype)]
        for grouped, like in ((d_key, self.key), (d_value, self.value)):
            b, h, length, d = grouped.shape
            grads.append(grouped.view(b, like.shape[1], h // like.shape[1], length, d).sum(2).to(like.dtype))
        d_bias = d_scores.to(self.bias.dtype) if bias_grad and self.bias is not None else None
        return (*grads, d_bias)


def _seed(like: torch.Tensor) -> int:
    """A seed for a dropout mask, drawn from the simulated GPU's generator (as the kernel advances the GPU's)."""
    generator = SIM.generator(like.device.index or 0)
    with generators.drawing(generator) as drawn:  # from the generator's Philox state, which it moves on
        seed = torch.randint(0, 2**62, (), generator=generator)
        drawn(seed)
    return int(seed)


# -- flash ---------------------------------------------------------------------------------------------------


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def flash_splits(work: int, sms: int, n_blocks: int, max_splits: int = 128) -> int:
    """How many parts flash splits the keys into (`num_splits_heuristic`): 1 once the work nearly fills the card.

    Otherwise the fewest splits whose wave efficiency is within 85% of the best, counting
    only split counts that change the blocks per split.
    """
    if work >= 0.8 * sms:
        return 1
    max_splits = min(max_splits, sms, n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or -(-n_blocks // n) != -(-n_blocks // (n - 1))

    efficiency = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = work * n / sms
            efficiency[n] = waves / math.ceil(waves)
    best = max(efficiency.values(), default=0.0)
    return next((n for n, e in efficiency.items() if e >= 0.85 * best), 1)


def flash_forward_scratch(query: torch.Tensor, key: torch.Tensor, dropout_p: float, sms: int) -> list[int]:
    """Bytes of the split-KV buffers flash's forward holds while it runs (`set_params_splitkv`); none without splits."""
    if dropout_p > 0.0:
        return []  # no split-KV kernel with dropout
    b, h, lq, d = query.shape
    hk, lk = key.shape[1], key.shape[2]
    if lq == 1 and h > hk and d % 8 == 0:
        h, lq = hk, h // hk  # one query of grouped heads: the groups become the queries
    head = _round_up(d, 8)
    head_rounded = _round_up(head, 32 if head <= 128 else 64)
    block_n = 256 if head <= 64 else 128 if head <= 128 else 64
    splits = flash_splits(b * h * -(-lq // 64), sms * 2, -(-lk // block_n))
    if splits <= 1:
        return []
    return [_nbytes((splits, b, h, lq), _FP32), _nbytes((splits, b, h, lq, head_rounded), _FP32)]


def flash_forward(args: tuple, kwargs: dict) -> tuple:
    """`_scaled_dot_product_flash_attention` (query, key, value (B, H, L, D), dropout_p, is_causal, ...)."""
    query, key, value = args[:3]
    dropout_p = _arg(args, kwargs, 3, "dropout_p", 0.0)
    is_causal = _arg(args, kwargs, 4, "is_causal", False)
    q, k, v = host_tensors(query, key, value)
    seed = _seed(query) if dropout_p > 0.0 else 0
    out_host, lse_host = _Attention(q, k, v, None, is_causal, kwargs.get("scale"), dropout_p, seed).forward()

    with _kernel(query) as kernel:
        out = kernel.output(_filled(q, out_host))
        lse = kernel.output(lse_host.contiguous())
        kernel.scratch(*flash_forward_scratch(query, key, dropout_p, cuda_memory.card().multi_processor_count))
        if dropout_p > 0.0:
            kernel.scratch(16)  # the RNG state made first, replaced by the one dropout fills
        rng_state = kernel.output(torch.tensor([seed, 0], dtype=torch.uint64))
        unused = kernel.output(torch.zeros((), dtype=torch.uint64))
        debug_mask = kernel.output(torch.empty(0, dtype=query.dtype))
    return (out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask)


def flash_backward(args: tuple, kwargs: dict) -> tuple:
    """`_scaled_dot_product_flash_attention_backward` (grad_out, query, key, value, out, logsumexp, ...)."""
    grad_out, query, key, value, out, lse = args[:6]
    dropout_p, is_causal, rng_state = args[10], args[11], args[12]
    g, q, k, v, o, lse_host, rng = host_tensors(grad_out, query, key, value, out, lse, rng_state)
    seed = int(rng[0]) if dropout_p > 0.0 and not rng.is_meta else 0
    attention = _Attention(q, k, v, None, is_causal, kwargs.get("scale"), dropout_p, seed)
    dq, dk, dv, _ = attention.backward(g, o, lse_host, bias_grad=False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic and torch.is_deterministic_algorithms_warn_only_enabled():
        _warn_once(
            "Flash Attention defaults to a non-deterministic algorithm. To explicitly enable determinism call "
            "torch.use_deterministic_algorithms(True, warn_only=False)."
        )
    with _kernel(query) as kernel:
        # the kernel reads grad_out and out as contiguous (B, L, H, D)
        kernel.scratch(_contiguous_copy_bytes(grad_out.transpose(1, 2)))
        kernel.scratch(_contiguous_copy_bytes(out.transpose(1, 2)))
        grads = tuple(kernel.output(_filled(t, grad)) for t, grad in ((q, dq), (k, dk), (v, dv)))
        kernel.scratch(*flash_backward_scratch(query, key, _deterministic()))
    return grads


def flash_backward_scratch(query: torch.Tensor, key: torch.Tensor, deterministic: bool) -> list[int]:
    """Bytes flash's backward holds besides its outputs (`mha_bwd`): softmax_d, the fp32 dq accumulator(s), and
    for grouped-query attention dk and dv over all query heads."""

    b, h, lq, d = query.shape
    hk, lk = key.shape[1], key.shape[2]
    head = _round_up(d, 8)
    head_rounded = _round_up(head, 32 if head <= 128 else 64)
    lq_rounded = _round_up(lq, 128)
    splits = 1
    if deterministic:
        splits = -(-cuda_memory.card().multi_processor_count // (b * h))
    sizes = [_nbytes((b, h, lq_rounded), _FP32), _nbytes((splits, b, lq_rounded, h, head_rounded), _FP32)]
    if hk != h:
        sizes += [_nbytes((b, lk, h, head), query.dtype)] * 2
    return sizes


# -- memory-efficient ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CutlassBackward:
    """One backward kernel of the memory-efficient family (`AttentionBackwardKernel`): what sizes its buffers."""

    arch: int  # the kernel's minimum compute capability (its `ArchTag`)
    block_i: int  # queries per block
    block_j: int  # keys per block
    max_k: int  # the largest head dim it takes
    dropout: bool = False
    seq_aligned: bool = False  # only for lengths multiple of the blocks

    def accumulates(self, is_half: bool) -> tuple[bool, bool]:
        """(dq through fp32 workspace, dk/dv through fp32 workspace)."""
        in_registers = is_half and self.max_k <= self.block_i
        return (self.arch >= 70 or is_half, not in_registers and is_half)


def _cutlass_list(half: bool, arch: int, cc: int) -> list[CutlassBackward]:
    """The kernels `dispatch_cutlassB` offers for a dtype on a card, in its order (kernels/cutlassB.h)."""
    K = CutlassBackward
    if arch == 80 and half:
        plain = [K(80, 64, 64, 32, seq_aligned=True), K(80, 64, 64, 32), K(80, 64, 64, 64, seq_aligned=True)]
        plain += [K(80, 64, 64, 64)] + ([K(80, 128, 64, 96)] if cc in (86, 89) else [])
        plain += [K(80, 128, 128, 128, seq_aligned=True), K(80, 128, 128, 128), K(80, 64, 64, 128, seq_aligned=True)]
        plain += [K(80, 64, 64, 128), K(80, 128, 64, 65536), K(80, 64, 64, 65536)]
        shapes = [(64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536)]
    elif (arch == 80 and not half) or (arch in (70, 75) and half):
        shapes = [(64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536)]
        plain = [K(arch, *shape) for shape in shapes]
        if arch == 70:  # sm70's half kernels also come in versions for block-aligned lengths
            plain = [k for shape in shapes[:4] for k in (K(70, *shape, seq_aligned=True), K(70, *shape))]
            plain += [K(70, *shape) for shape in shapes[4:]]
    else:
        shapes = [(64, 64, 32), (64, 64, 64), (64, 64, 128), (64, 64, 65536)]
        plain = [K(arch, *shape) for shape in shapes]
    return plain + [K(arch, *shape, dropout=True) for shape in shapes]


#: shared memory (opt-in per block) the 128 x 128 kernels are taken to need: more than sm 8.6/8.9's 99 KiB
#: (torch builds a 128 x 64 kernel for head dim 96 for those cards alone); the others fit every card here
BIG_KERNEL_SMEM = 100 * 1024


def cutlass_backward_kernel(dtype: torch.dtype, card: Any, max_k: int, lq: int, lk: int, dropout: bool) -> Any:
    """The backward kernel the memory-efficient backward launches: the first of the list that fits."""
    cc = card.major * 10 + card.minor
    arch = 80 if cc >= 80 else 75 if cc >= 75 else 70 if cc >= 70 else 50
    half = dtype != _FP32
    for kernel in _cutlass_list(half, arch, cc):
        if kernel.max_k < max_k or (dropout and not kernel.dropout):
            continue
        if kernel.seq_aligned and (lq % kernel.block_i or lk % kernel.block_j):
            continue
        if kernel.block_i == kernel.block_j == 128 and card.shared_memory_per_block_optin < BIG_KERNEL_SMEM:
            continue
        return kernel
    return None


def efficient_backward_workspace(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel: Any) -> int:
    """Bytes of the kernel's fp32 workspace (`workspace_size()`): dq staging per query block, and dk/dv
    accumulators per key split when they do not stay in registers."""
    b, h, lq, d = query.shape
    lk, dv = key.shape[2], value.shape[3]
    grad_q, grad_kv = kernel.accumulates(query.dtype != _FP32)
    splits = -(-lk // kernel.block_j) if kernel.arch >= 70 and not _deterministic() else 1
    gk = splits * kernel.block_j * _round_up(d, kernel.block_i) if grad_kv else 0
    gv = splits * kernel.block_j * _round_up(dv, kernel.block_i) if grad_kv else 0
    gq = 0
    if grad_q:  # one staging tile (a lock, a counter, padding, block_i x block_j floats) per tile of dq
        gq = -(-lq // kernel.block_i) * -(-d // kernel.block_j) * (4 + kernel.block_i * kernel.block_j)
    return b * h * _round_up(gk + gv + gq, 4) * 4


def efficient_accumulates(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the forward keeps an fp32 output accumulator: head dims above 128 (its kernel then loops over
    the value's head dim) in a 16-bit type."""
    return max(query.shape[-1], value.shape[-1]) > 128 and query.dtype != _FP32


def _check_bias(query: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is not None and bias.dtype != query.dtype:
        raise RuntimeError("invalid dtype for bias - should match query's dtype")


def _padded_lse(lse: torch.Tensor, length: int, wanted: bool) -> torch.Tensor:
    """The logsumexp as the memory-efficient forward keeps it: (B, H, L rounded to 32), or empty when not wanted."""
    b, h = lse.shape[:2]
    padded = torch.zeros((b, h, _round_up(length, 32) if wanted else 0), dtype=_FP32, device=lse.device)
    if wanted and not padded.is_meta:
        padded[:, :, :length] = lse
    return padded


def efficient_forward(args: tuple, kwargs: dict) -> tuple:
    """`_scaled_dot_product_efficient_attention` (query, key, value, attn_bias, compute_log_sumexp, dropout_p, ...)."""
    query, key, value, bias = args[:4]
    wanted = _arg(args, kwargs, 4, "compute_log_sumexp", False)
    dropout_p = _arg(args, kwargs, 5, "dropout_p", 0.0)
    is_causal = _arg(args, kwargs, 6, "is_causal", False)
    _check_bias(query, bias)
    q, k, v, b = host_tensors(query, key, value, bias)
    seed = _seed(query) if dropout_p > 0.0 else 0
    out_host, lse_host = _Attention(q, k, v, b, is_causal, kwargs.get("scale"), dropout_p, seed).forward()
    with _kernel(query) as kernel:
        out = kernel.output(_bshd(out_host))
        lse = kernel.output(_padded_lse(lse_host, query.shape[2], wanted))
        if efficient_accumulates(query, value):
            kernel.scratch(_nbytes(out.shape, _FP32))
    # the RNG seed and offset stay on the host (outside graph capture)
    return (out, lse, torch.tensor(seed, dtype=torch.int64), torch.tensor(0, dtype=torch.int64))


def efficient_backward(args: tuple, kwargs: dict) -> tuple:
    """`_scaled_dot_product_efficient_attention_backward` (grad_out, query, key, value, attn_bias, out, logsumexp,
    philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal)."""
    grad_out, query, key, value, bias, out, lse, seed_t = args[:8]
    dropout_p, grad_input_mask = args[9], args[10]
    is_causal = _arg(args, kwargs, 11, "is_causal", False)
    bias_grad = bias is not None and bool(grad_input_mask[3])
    g, q, k, v, b, o, lse_host = host_tensors(grad_out, query, key, value, bias, out, lse)
    seed = int(seed_t) if dropout_p > 0.0 else 0
    attention = _Attention(q, k, v, b, is_causal, kwargs.get("scale"), dropout_p, seed)
    dq, dk, dv, db = attention.backward(g, o, lse_host[:, :, : query.shape[2]], bias_grad)

    card = cuda_memory.card()
    with _kernel(query) as kernel:
        kernel.scratch(_contiguous_copy_bytes(grad_out.transpose(1, 2)))  # the kernel reads it contiguous
        grads = [kernel.output(_bshd(grad)) for grad in (dq, dk, dv)]
        grad_bias = kernel.output(_padded_bias_grad(db)) if bias_grad and db is not None else None
        max_k = max(query.shape[-1], value.shape[-1])
        chosen = cutlass_backward_kernel(query.dtype, card, max_k, query.shape[2], key.shape[2], dropout_p > 0.0)
        if chosen is None:
            raise RuntimeError("cutlassB: no kernel found to launch!")
        _delta(kernel, query, value, chosen, card)
        kernel.scratch(efficient_backward_workspace(query, key, value, chosen))
    return (*grads, grad_bias)


def _delta(kernel: _Kernel, query: torch.Tensor, value: torch.Tensor, chosen: Any, card: Any) -> None:
    """delta (B, H, L) fp32: allocated for 16-bit kernels that compute it, else computed by tensor ops first."""
    b, h, lq = query.shape[:3]
    is_half = query.dtype != _FP32
    if is_half and (chosen.max_k <= chosen.block_i or chosen.arch != 70):
        kernel.scratch(_nbytes((b, h, lq), _FP32))
        return
    # (grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous(): temporaries until the statement ends
    product = (b, lq, h, value.shape[-1])
    temporaries = kernel.scratch(*([_nbytes(product, _FP32)] * 2 if is_half else []))
    temporaries += kernel.scratch(_nbytes(product, _FP32), _nbytes((b, lq, h), _FP32))
    kernel.scratch(_nbytes((b, h, lq), _FP32))
    kernel.free(temporaries)


def _padded_bias_grad(grad: torch.Tensor) -> torch.Tensor:
    """The bias gradient as the kernel writes it: last dim padded to 16, seen unpadded."""
    *lead, last = grad.shape
    padded = torch.empty((*lead, _round_up(last, 16)), dtype=grad.dtype, device=grad.device)[..., :last]
    return padded if padded.is_meta else padded.copy_(grad)


# -- cuDNN ----------------------------------------------------------------------------------------------------


def cudnn_forward(args: tuple, kwargs: dict) -> tuple:
    """`_scaled_dot_product_cudnn_attention` (query, key, value, attn_bias, compute_log_sumexp, dropout_p, ...)."""
    query, key, value, bias = args[:4]
    wanted = _arg(args, kwargs, 4, "compute_log_sumexp", False)
    dropout_p = _arg(args, kwargs, 5, "dropout_p", 0.0)
    is_causal = _arg(args, kwargs, 6, "is_causal", False)
    q, k, v, b = host_tensors(query, key, value, bias)
    seed = _seed(query) if dropout_p > 0.0 else 0
    out_host, lse_host = _Attention(q, k, v, b, is_causal, kwargs.get("scale"), dropout_p, seed).forward()
    with _kernel(query) as kernel:
        out = kernel.output(_in_layout(q, out_host))  # the output's dims ordered in memory as the query's
        stats = kernel.output(lse_host.unsqueeze(-1).contiguous()) if wanted else None
    seeds = (torch.tensor(seed, dtype=torch.int64), torch.tensor(0, dtype=torch.int64))
    return (out, stats, None, None, query.shape[2], key.shape[2], *seeds, None)


def cudnn_backward(args: tuple, kwargs: dict) -> tuple:
    """`_scaled_dot_product_cudnn_attention_backward` (grad_out, query, key, value, out, logsumexp, philox_seed,
    philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal)."""
    grad_out, query, key, value, out, lse, seed_t, _, bias = args[:9]
    dropout_p, is_causal = args[13], args[14]
    g, q, k, v, b, o, lse_host = host_tensors(grad_out, query, key, value, bias, out, lse)
    seed = int(seed_t) if dropout_p > 0.0 else 0
    attention = _Attention(q, k, v, b, is_causal, kwargs.get("scale"), dropout_p, seed)
    dq, dk, dv, _ = attention.backward(g, o, lse_host.squeeze(-1), bias_grad=False)
    with _kernel(query) as kernel:
        grads = tuple(kernel.output(_filled(t, grad)) for t, grad in ((q, dq), (k, dk), (v, dv)))
    return grads
