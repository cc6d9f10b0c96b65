"""Variable-length attention on simulated GPUs: `torch.nn.attention.varlen.varlen_attn` (torchtitan's varlen
flavour) and FlashAttention's own `_flash_attention_forward/backward`, packed and padded, against attention
of each sequence apart; and ops written in Python (`torch.library.custom_op`) running on the GPU's tensors,
as varlen's own op does on a GPU."""

import uuid

import pytest
import torch
import torch.nn.functional as F

from harness import distributed_test

SIZES = [2, 4]


def _per_sequence(q, k, v, cu, mask_of=None):
    """Attention of each packed sequence apart (heads repeated for grouped queries), on the host."""
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
        mask = mask_of(end - start) if mask_of else None
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _inputs(rank, heads=4, kv_heads=2, dim=16):
    torch.manual_seed(rank)
    cu = torch.tensor([0, 3, 8, 8 + rank + 2], dtype=torch.int32)
    total = int(cu[-1])
    return [torch.randn(total, h, dim) for h in (heads, kv_heads, kv_heads)], cu


@distributed_test(world_size=SIZES, device="cuda")
def test_varlen_attention_is_attention_of_each_packed_sequence_forward_and_backward(rank, world_size):
    from torch.nn.attention.varlen import varlen_attn

    (q, k, v), cu = _inputs(rank)
    on_gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    longest = int((cu[1:] - cu[:-1]).max())
    out = varlen_attn(*on_gpu, cu.cuda(), cu.cuda(), longest, longest, window_size=(-1, 0), enable_gqa=True)
    assert out.is_cuda and out.shape == q.shape
    host = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _per_sequence(*host, cu)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
    (out * out).sum().backward()
    (want * want).sum().backward()
    for got, ref in zip(on_gpu, host, strict=True):
        torch.testing.assert_close(got.grad.cpu(), ref.grad, atol=1e-5, rtol=1e-5)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_sliding_window_masks_as_flash_attention_does(rank, world_size):
    from torch.nn.attention.varlen import varlen_attn

    (q, k, v), cu = _inputs(rank, heads=2, kv_heads=2)
    longest = int((cu[1:] - cu[:-1]).max())
    out = varlen_attn(*(t.cuda() for t in (q, k, v)), cu.cuda(), cu.cuda(), longest, longest, window_size=(1, 0))

    def window(n):  # each query sees itself and the one key before it
        rows, cols = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        return (cols <= rows) & (cols >= rows - 1)

    torch.testing.assert_close(out.cpu(), _per_sequence(q, k, v, cu, window), atol=1e-5, rtol=1e-5)


@distributed_test(world_size=SIZES, device="cuda")
def test_flash_attentions_padded_op_and_its_memory(rank, world_size):
    torch.manual_seed(rank)
    q, k, v = (torch.randn(2, 6, 4, 16, dtype=torch.bfloat16) for _ in range(3))  # (B, L, H, D)
    before = torch.cuda.memory_allocated()
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        q.cuda(), k.cuda(), v.cuda(), None, None, 6, 6, 0.0, True, False
    )
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 6) and lse.dtype == torch.float32 and rng.shape == (2,)
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out.cpu().float(), want.transpose(1, 2), atol=2e-2, rtol=2e-2)
    # output (512-byte blocks of the caching allocator), logsumexp, RNG state and the spare
    assert torch.cuda.memory_allocated() - before >= out.numel() * 2 + lse.numel() * 4


@distributed_test(world_size=SIZES, device="cuda")
def test_paged_kv_is_refused_by_name(rank, world_size):
    (q, k, v), cu = _inputs(rank, heads=2, kv_heads=2)
    table = torch.zeros(3, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="block_table"):
        torch.ops.aten._flash_attention_forward(
            q.cuda(), k.cuda(), v.cuda(), cu.cuda(), cu.cuda(), 5, 5, 0.0, True, False, block_table=table
        )


@distributed_test(world_size=SIZES, device="cuda")
def test_an_op_written_in_python_gets_the_gpus_tensors(rank, world_size):
    name = f"accel_test_{uuid.uuid4().hex[:8]}::where_am_i"
    seen = []

    @torch.library.custom_op(name, mutates_args=())
    def where_am_i(x: torch.Tensor) -> torch.Tensor:
        seen.append(str(x.device))
        return x * 2 if x.is_cuda else x * 0  # code that branches on the device, as varlen_attn's does

    x = torch.ones(3, device="cuda")
    out = where_am_i(x)
    assert seen == [f"cuda:{rank}"] and out.is_cuda and out.tolist() == [2.0, 2.0, 2.0]
    assert where_am_i(torch.ones(2)).tolist() == [0.0, 0.0]  # host tensors still take the host's path
