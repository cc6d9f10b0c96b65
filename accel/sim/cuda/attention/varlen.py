"""FlashAttention's own ops on a simulated GPU: `_flash_attention_forward` / `_flash_attention_backward`,
padded (B, L, H, D) or packed with cumulative sequence lengths (total, H, D), which
`torch.nn.attention.varlen.varlen_attn` and torchtitan's varlen flavour call.

The numbers come from the host's flash kernel, one packed sequence at a time; the masks FlashAttention-2
applies are written out where the host kernel has none: causal attention aligned to the bottom right when
queries and keys differ in length, and sliding windows (`window_size_left/right`). Grouped-query
attention repeats the key and value heads for the host kernel and sums their gradients back. Memory as
`mha_varlen_fwd` / `mha_varlen_bwd` take it: the output (`empty_like` the query), the logsumexp
(H, total) fp32 (padded: (B, H, L)), the RNG state; in backward dq/dk/dv, softmax_d and the fp32 dq
accumulator. Paged KV (`block_table`), ALiBi slopes and split-KV counts are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.cuda.attention.kernels import _FP32, _arg, _Attention, _kernel, _round_up, _seed
from accel.sim.cuda.tensors.cuda_tensor import host_tensors

aten = torch.ops.aten


def _refuse_unsupported(kwargs: dict) -> None:
    for name, what in (("block_table", "paged KV"), ("alibi_slopes", "ALiBi"), ("num_splits", "split-KV counts")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"_flash_attention_forward with {name} ({what}) is not simulated: leave {name} unset on simulated GPUs"
            )


def _mask(lq: int, lk: int, is_causal: bool, left: int, right: int) -> torch.Tensor | None:
    """FlashAttention-2's mask as an additive bias (None when no mask or the host kernel's causal flag serves)."""
    if is_causal:
        right = 0  # causal is a window of nothing to the right
    if left < 0 and (right < 0 or (right == 0 and lq == lk)):
        return None
    offset = lk - lq  # bottom-right alignment
    rows = torch.arange(lq).unsqueeze(1) + offset
    cols = torch.arange(lk).unsqueeze(0)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        keep &= cols <= rows + right
    if left >= 0:
        keep &= cols >= rows - left
    return torch.zeros(lq, lk).masked_fill(~keep, float("-inf"))


def _spans(cum: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    if cum is None:
        return [(0, total)]
    ends = [int(x) for x in cum.tolist()]
    return list(zip(ends[:-1], ends[1:], strict=True))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: dict) -> _Attention:
    """One sequence's attention: (L, H, D) slices as the (1, H, L, D) the host kernel takes."""
    lq, lk = q.shape[0], k.shape[0]
    bias = _mask(lq, lk, how["is_causal"], how["left"], how["right"])
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
    causal = bias is None and (how["is_causal"] or how["right"] == 0)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return _Attention(q, k, v, bias, causal, how["scale"], how["dropout_p"], how["seed"])


def _how(args: tuple, kwargs: dict, dropout_at: int, causal_at: int, seed: int) -> dict:
    left = kwargs.get("window_size_left")
    right = kwargs.get("window_size_right")
    return {
        "dropout_p": _arg(args, kwargs, dropout_at, "dropout_p", 0.0),
        "is_causal": _arg(args, kwargs, causal_at, "is_causal", False),
        "scale": kwargs.get("scale"),
        "left": -1 if left is None else int(left),
        "right": -1 if right is None else int(right),
        "seed": seed,
    }


def _segments(q: torch.Tensor, k: torch.Tensor, cum_q: Any, cum_k: Any, used_k: Any) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of each sequence in the packed layout."""
    queries = _spans(cum_q, q.shape[0])
    keys = _spans(cum_k, k.shape[0])
    if used_k is not None:
        keys = [(start, start + int(n)) for (start, _), n in zip(keys, used_k.tolist(), strict=True)]
    return [(slice(*a), slice(*b)) for a, b in zip(queries, keys, strict=True)]


def flash_forward(args: tuple, kwargs: dict) -> tuple:
    """`_flash_attention_forward` (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, ...)."""
    _refuse_unsupported(kwargs)
    query, key, value, cum_q, cum_k = args[:5]
    dropout_p = _arg(args, kwargs, 7, "dropout_p", 0.0)
    how = _how(args, kwargs, 7, 8, _seed(query) if dropout_p > 0.0 else 0)
    q, k, v, cq, ck, used = host_tensors(query, key, value, cum_q, cum_k, kwargs.get("seqused_k"))
    packed = cum_q is not None
    out_host, lse_host = _forward_host(q, k, v, cq, ck, used, how, packed)
    with _kernel(query) as kernel:
        out = kernel.output(out_host)
        lse = kernel.output(lse_host)
        rng_state = kernel.output(torch.tensor([how["seed"], 0], dtype=torch.uint64))
        unused = kernel.output(torch.zeros((), dtype=torch.uint64))
        debug_mask = kernel.output(torch.empty(0, dtype=query.dtype))
    return out, lse, rng_state, unused, debug_mask


def _forward_host(q: Any, k: Any, v: Any, cq: Any, ck: Any, used: Any, how: dict, packed: bool) -> tuple:
    if not packed:  # (B, L, H, D): each batch row is a sequence
        per_row = [_forward_host(q[b], k[b], v[b], None, None, None, how, True) for b in range(q.shape[0])]
        outs, lses = zip(*per_row, strict=True)
        return torch.stack(outs), torch.stack(lses)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=_FP32, device=q.device)
    if q.is_meta:
        return out, lse
    for rows, keys in _segments(q, k, cq, ck, used):
        seq_out, seq_lse = _attention(q[rows], k[keys], v[keys], how).forward()
        out[rows] = seq_out[0].transpose(0, 1)
        lse[:, rows] = seq_lse[0]
    return out, lse


def flash_backward(args: tuple, kwargs: dict) -> tuple:
    """`_flash_attention_backward` (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, ...)."""
    grad_out, query, key, value, out, lse, cum_q, cum_k = args[:8]
    rng_state = args[12]
    g, q, k, v, o, lse_host, cq, ck, rng = host_tensors(grad_out, query, key, value, out, lse, cum_q, cum_k, rng_state)
    dropout_p = args[10]
    how = _how(args, kwargs, 10, 11, int(rng[0]) if dropout_p > 0.0 and not rng.is_meta else 0)
    packed = cum_q is not None and cum_q.numel() > 0
    grads = _backward_host(g, q, k, v, o, lse_host, cq if packed else None, ck if packed else None, how)
    with _kernel(query) as kernel:
        outputs = tuple(kernel.output(grad) for grad in grads)
        kernel.scratch(*_backward_scratch(query, cum_q if packed else None, args[8]))
    return outputs


def _backward_host(g: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cq: Any, ck: Any, how: dict) -> tuple:
    if cq is None and q.dim() == 4:  # (B, L, H, D)
        per_row = [_backward_host(g[b], q[b], k[b], v[b], o[b], lse[b], None, None, how) for b in range(q.shape[0])]
        return tuple(torch.stack(parts) for parts in zip(*per_row, strict=True))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if q.is_meta:
        return dq, dk, dv
    groups = q.shape[1] // k.shape[1]
    for rows, keys in _segments(q, k, cq, ck, None):
        attention = _attention(q[rows], k[keys], v[keys], how)
        seq_g, seq_o = (t[rows].transpose(0, 1).unsqueeze(0) for t in (g, o))
        gq, gk, gv, _ = attention.backward(seq_g, seq_o, lse[:, rows].unsqueeze(0), bias_grad=False)
        dq[rows] = gq[0].transpose(0, 1)
        for grad, into in ((gk, dk), (gv, dv)):
            grad = grad[0].transpose(0, 1)  # (L, H, D) over the repeated heads
            if groups > 1:
                grad = grad.unflatten(1, (k.shape[1], groups)).sum(2)
            into[keys] = grad
    return dq, dk, dv


def _backward_scratch(query: torch.Tensor, cum_q: torch.Tensor | None, max_q: int) -> list[int]:
    """softmax_d (B, H, max_q rounded to 128) and the dq accumulator (total + 128 B, H, D rounded) in fp32."""
    if cum_q is None:
        b, length, h, d = query.shape
        total = b * length
    else:
        total, h, d = query.shape
        b = cum_q.numel() - 1
        length = int(max_q)
    head = _round_up(_round_up(d, 8), 32 if d <= 128 else 64)
    return [b * h * _round_up(length, 128) * 4, (total + 128 * b) * h * head * 4]
