"""`scaled_dot_product_attention` on simulated GPUs runs the backend the card would, with its memory.

Which backend a call takes is what torch 2.13 decides on the card (capability, dtype, head
dim, mask, grouped-query heads, the `sdpa_kernel` / `enable_*_sdp` switches), seen as a
profiler sees it: the op dispatched. The memory a forward and backward take is computed
here from the shapes by the CUDA kernels' allocation rules (flash_api.cpp, attention.cu,
attention_backward.cu, the memory-efficient kernels' headers), each buffer rounded as the
caching allocator rounds it, and compared with `memory_allocated` / `max_memory_allocated`.
The numbers are the math path's within tolerance.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from harness import distributed_test

GiB = 1 << 30
BF16 = torch.bfloat16
_FUSED = {
    "aten._scaled_dot_product_flash_attention.default": "flash",
    "aten._scaled_dot_product_efficient_attention.default": "efficient",
    "aten._scaled_dot_product_cudnn_attention.default": "cudnn",
}


class _Ops(TorchDispatchMode):
    """Records the ops dispatched below autograd, as a profiler lists them."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def backend_of(fn):
    """(the backend `fn`'s attention ran on, its output): the fused op dispatched, or math (a softmax of scores)."""
    with _Ops() as ops:
        out = fn()
    fused = {_FUSED[name] for name in ops.names if name in _FUSED}
    assert len(fused) <= 1, ops.names
    if fused:
        return fused.pop(), out
    assert "aten._safe_softmax.default" in ops.names, ops.names
    return "math", out


def qkv(b, hq, hk, length, d, dtype=BF16, grad=False, seed=0):
    """Query (B, Hq, L, D) and key/value (B, Hk, L, D) on the current GPU, laid out (B, L, H, D) as models make them."""
    torch.manual_seed(seed)
    shapes = ((b, length, hq, d), (b, length, hk, d), (b, length, hk, d))
    return [torch.randn(s, dtype=dtype).cuda().transpose(1, 2).requires_grad_(grad) for s in shapes]


def attend(q, k, v, **kwargs):
    return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def rounded(nbytes):
    """A request as the caching allocator rounds it: a multiple of 512 bytes, at least 512."""
    return max(512, -(-nbytes // 512) * 512)


def nbytes(shape, dtype):
    return math.prod(shape) * dtype.itemsize


def up(x, multiple):
    return -(-x // multiple) * multiple


# -- which backend -------------------------------------------------------------------------------------


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_an_h100_runs_cudnn_first_then_flash_efficient_math():
    q, k, v = qkv(2, 8, 8, 64, 64)
    assert backend_of(attend(q, k, v, is_causal=True))[0] == "cudnn"  # sm 9.0 puts cuDNN first
    gq, gk, gv = qkv(2, 8, 2, 64, 64)
    assert backend_of(attend(gq, gk, gv, is_causal=True, enable_gqa=True))[0] == "cudnn"
    assert backend_of(attend(*qkv(2, 4, 4, 64, 256), is_causal=True))[0] == "flash"  # cuDNN 9.19: head dim <= 128
    assert backend_of(attend(*qkv(2, 4, 4, 64, 20, dtype=torch.float16)))[0] == "flash"  # padded to 24
    assert backend_of(attend(*qkv(2, 4, 4, 64, 64, dtype=torch.float32)))[0] == "efficient"  # fp32: no flash
    # fp32 with grouped heads: the 2.13 efficient kernel takes none, flash and cuDNN no fp32
    assert backend_of(attend(*qkv(2, 8, 2, 64, 64, dtype=torch.float32), enable_gqa=True))[0] == "math"
    mask = torch.randn(64, 64, dtype=BF16, device="cuda")
    assert backend_of(attend(q, k, v, attn_mask=mask))[0] == "cudnn"
    wanted = mask.clone().requires_grad_()  # cuDNN gives no mask gradient; flash takes no mask
    assert backend_of(attend(q, k, v, attn_mask=wanted))[0] == "efficient"
    # causal with fewer queries than keys: flash refuses (its causal mask would be aligned to the bottom right)
    short = q[:, :, :16]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        assert backend_of(attend(short, k, v, is_causal=True))[0] == "efficient"


@distributed_test(world_size=[2], device="cuda", gpu="A100-80GB")
def test_an_a100_runs_flash_first():
    q, k, v = qkv(2, 8, 2, 64, 64)
    assert backend_of(attend(q, k, v, is_causal=True, enable_gqa=True))[0] == "flash"
    # grouped heads without enable_gqa: no fused kernel takes them, and the math path fails as on the card
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        F.scaled_dot_product_attention(q, k, v)
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    assert backend_of(attend(*qkv(2, 4, 4, 64, 64), attn_mask=mask))[0] == "efficient"  # flash takes no mask
    # training with head dim 256 is fine on sm 8.0 (not on sm 8.6/8.9)
    assert backend_of(attend(*qkv(1, 2, 2, 64, 256, grad=True)))[0] == "flash"


@distributed_test(world_size=[2], device="cuda", gpu="L4")
def test_an_l4_trains_some_head_dims_without_flash():
    # flash's backward on sm 8.6-8.9 lacks head dims in (192, 224], and above 224 with dropout
    q, k, v = qkv(1, 2, 2, 64, 224, grad=True)
    assert backend_of(attend(q, k, v))[0] == "efficient"
    with torch.no_grad():
        assert backend_of(attend(q, k, v))[0] == "flash"  # no backward: flash
    q, k, v = qkv(1, 2, 2, 64, 256, grad=True)
    assert backend_of(attend(q, k, v))[0] == "flash"
    assert backend_of(attend(q, k, v, dropout_p=0.5))[0] == "efficient"


@distributed_test(world_size=[2], device="cuda", gpu="T4")
def test_a_t4_has_no_flash_nor_cudnn_and_no_bf16_kernel():
    assert backend_of(attend(*qkv(2, 4, 4, 64, 64, dtype=torch.float16), is_causal=True))[0] == "efficient"
    assert backend_of(attend(*qkv(2, 4, 4, 64, 64), is_causal=True))[0] == "math"  # bf16 below sm 8.0
    assert backend_of(attend(*qkv(2, 4, 4, 64, 20, dtype=torch.float16)))[0] == "math"  # head dim not a multiple of 8


# -- the switches ---------------------------------------------------------------------------------------


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_the_switches_choose_as_on_the_card():
    q, k, v = qkv(2, 8, 2, 64, 64)
    gqa = attend(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert backend_of(gqa)[0] == "flash"
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert backend_of(gqa)[0] == "flash"
        torch.backends.cuda.enable_flash_sdp(False)
        assert backend_of(gqa)[0] == "math"  # efficient takes no grouped heads
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.backends.cuda.enable_flash_sdp(True)
    plain = attend(*qkv(2, 4, 4, 64, 64), is_causal=True)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert backend_of(plain)[0] == "efficient"
    with sdpa_kernel(SDPBackend.MATH):
        assert backend_of(plain)[0] == "math"
    assert backend_of(plain)[0] == "cudnn"


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_a_priority_set_before_the_first_attention_holds():
    plain = attend(*qkv(2, 4, 4, 64, 64), is_causal=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert backend_of(plain)[0] == "flash"
    assert backend_of(plain)[0] == "cudnn"  # the order torch had set before the context: cuDNN first on sm 9.0


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_when_no_backend_may_run_torchs_errors():
    q, k, v = qkv(2, 8, 2, 64, 64)
    only_efficient = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
    with only_efficient, pytest.warns(UserWarning) as caught, pytest.raises(RuntimeError, match="^No available kernel"):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    said = [str(w.message) for w in caught]
    assert said[0] == "Memory efficient kernel not used because:"
    assert said[1].startswith("For dense input, both fused kernels require query, key and value to have the same num")
    assert said[2:4] == ["Flash attention kernel not used because:", "Flash attention has been runtime disabled."]
    assert said[4:] == ["cuDNN attention kernel not used because:", "cuDNN attention has been runtime disabled."]
    with sdpa_kernel([]), pytest.raises(RuntimeError, match="No viable backend for scaled_dot_product_attention"):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # math switched off alone leaves the overrideable backend on: torch then fails so
    torch.backends.cuda.enable_math_sdp(False)
    try:
        with pytest.raises(RuntimeError, match="^Invalid backend$"):
            F.scaled_dot_product_attention(*qkv(2, 8, 2, 64, 64, dtype=torch.float32), enable_gqa=True)
    finally:
        torch.backends.cuda.enable_math_sdp(True)


@distributed_test(world_size=[2], device="cuda", gpu="H200")
def test_cudnn_deprioritized_by_the_environment_at_the_first_attention():
    os.environ["TORCH_CUDNN_SDPA_DEPRIORITIZED"] = "1"
    try:
        assert backend_of(attend(*qkv(2, 8, 2, 64, 64), enable_gqa=True))[0] == "flash"
    finally:
        del os.environ["TORCH_CUDNN_SDPA_DEPRIORITIZED"]
    # torch reads it once, at the process's first attention: the order stays
    assert backend_of(attend(*qkv(2, 8, 2, 64, 64), enable_gqa=True))[0] == "flash"


# -- the numbers ----------------------------------------------------------------------------------------


def reference(q, k, v, **kwargs):
    """The math path's numbers, on the host in fp32 (gradients flow to host leaves given)."""
    q, k, v = (t if t.device.type == "cpu" else t.detach().cpu().float() for t in (q, k, v))
    mask = kwargs.pop("attn_mask", None)
    if mask is not None and mask.device.type != "cpu":
        mask = mask.cpu() if mask.dtype == torch.bool else mask.detach().cpu().float()
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


@distributed_test(world_size=[2], device="cuda", gpu="A100-80GB")
def test_each_backend_gives_the_math_paths_numbers():
    cases = [
        ("flash", qkv(2, 8, 2, 48, 64, grad=True), {"is_causal": True, "enable_gqa": True}, 2e-2),
        ("efficient", qkv(2, 4, 4, 48, 64, dtype=torch.float32, grad=True), {"is_causal": True}, 1e-5),
    ]
    mask = torch.randn(48, 48).cuda()
    cases.append(("efficient", qkv(1, 4, 4, 48, 32, dtype=torch.float32, grad=True), {"attn_mask": mask}, 1e-5))
    for backend, (q, k, v), kwargs, tol in cases:
        ran, out = backend_of(attend(q, k, v, **kwargs))
        assert ran == backend
        torch.testing.assert_close(out.float().cpu(), reference(q, k, v, **kwargs), atol=tol, rtol=tol)
        grad = torch.randn_like(out)
        out.backward(grad)
        leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v)]
        reference(*leaves, **kwargs).backward(grad.cpu().float())
        for mine, theirs in zip((q, k, v), leaves, strict=True):
            assert mine.grad.shape == mine.shape  # grouped heads: dk, dv have the key/value heads
            torch.testing.assert_close(mine.grad.float().cpu(), theirs.grad, atol=5 * tol, rtol=5 * tol)
    # a mask that wants its gradient: memory-efficient attention gives it (its length 36 padded to 40 and cut back)
    q, k, v = qkv(2, 4, 4, 36, 32, dtype=torch.float32, grad=True)
    mask = torch.randn(36, 36).cuda().requires_grad_()
    ran, out = backend_of(attend(q, k, v, attn_mask=mask))
    assert ran == "efficient"
    grad = torch.randn_like(out)
    out.backward(grad)
    host_mask = mask.detach().cpu().requires_grad_()
    reference(q, k, v, attn_mask=host_mask).backward(grad.cpu())
    torch.testing.assert_close(mask.grad.cpu(), host_mask.grad, atol=1e-5, rtol=1e-5)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        q, k, v = qkv(2, 8, 2, 48, 64)
        bool_mask = torch.rand(48, 48, device="cuda") > 0.3
        ran, out = backend_of(attend(q, k, v, attn_mask=bool_mask.fill_diagonal_(True), enable_gqa=True))
        assert ran == "cudnn"
        expected = reference(q, k, v, attn_mask=bool_mask, enable_gqa=True)
        torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


@distributed_test(world_size=[2], device="cuda", gpu="A100-80GB")
def test_dropout_backward_drops_what_the_forward_dropped():
    for dtype, backend, tol in ((BF16, "flash", 5e-2), (torch.float32, "efficient", 1e-4)):
        q, k, v = qkv(2, 4, 4, 32, 64, dtype=dtype, grad=True)
        torch.cuda.manual_seed(3)
        ran, out = backend_of(attend(q, k, v, dropout_p=0.25))
        assert ran == backend
        torch.cuda.manual_seed(3)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, dropout_p=0.25), out)  # the GPU's generator
        assert not torch.allclose(out.float().cpu(), reference(q, k, v), atol=1e-2)  # some weights were dropped
        grad = torch.randn_like(out)
        out.backward(grad)
        # out = (dropped weights) @ v, linear in v: <grad, out> = <dv, v> only with the forward's own mask
        lhs = (grad.float() * out.float()).sum().item()
        rhs = (v.grad.float() * v.float()).sum().item()
        assert lhs == pytest.approx(rhs, rel=tol, abs=tol)


# -- the memory -----------------------------------------------------------------------------------------


def flash_forward_bytes(b, hq, length, d, dtype):
    """Flash's forward: the output (the query's layout), logsumexp (B, H, L) fp32, an RNG state (16 B), a spare 8 B."""
    return rounded(nbytes((b, length, hq, d), dtype)) + rounded(nbytes((b, hq, length), torch.float32)) + 512 + 512


def flash_backward_bytes(b, hq, hk, length, d, dtype):
    """Flash's backward: dq, dk, dv; softmax_d (B, H, L up to 128) fp32; the dq accumulator (B, L up to 128, H,
    D up to 32) fp32; with grouped heads, dk and dv over all query heads."""
    grads = rounded(nbytes((b, length, hq, d), dtype)) + 2 * rounded(nbytes((b, length, hk, d), dtype))
    softmax_d = rounded(nbytes((b, hq, up(length, 128)), torch.float32))
    accumulator = rounded(nbytes((b, up(length, 128), hq, up(d, 32)), torch.float32))
    expanded = 2 * rounded(nbytes((b, length, hq, d), dtype)) if hq != hk else 0
    return grads + softmax_d + accumulator + expanded


@distributed_test(world_size=[2], device="cuda", gpu="A100-80GB")
def test_grouped_query_attention_takes_flashs_memory_not_maths():
    b, hq, hk, length, d = 2, 8, 2, 256, 64
    q, k, v = qkv(b, hq, hk, length, d, grad=True)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
    assert torch.cuda.memory_allocated() - before == flash_forward_bytes(b, hq, length, d, BF16)
    assert torch.cuda.max_memory_allocated() - before == flash_forward_bytes(b, hq, length, d, BF16)
    grad = torch.randn_like(out)  # (B, L, H, D) like out: no contiguous copies in the backward
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    assert torch.cuda.max_memory_allocated() - start == flash_backward_bytes(b, hq, hk, length, d, BF16)
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    # the graph is gone: logsumexp and RNG state freed, the gradients kept (k and v not repeated)
    kept = rounded(nbytes(q.shape, BF16)) + 2 * rounded(nbytes(k.shape, BF16))
    assert torch.cuda.memory_allocated() - start == kept - rounded(nbytes((b, hq, length), torch.float32)) - 1024
    # the math path holds (B, Hq, L, L) fp32 scores and repeats k and v
    del out, grad
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert torch.cuda.max_memory_allocated() - start > 2 * nbytes((b, hq, length, length), torch.float32)


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_flash_splits_the_keys_of_a_decoding_step():
    # one query, 32 query heads on 8 key/value heads, 4096 keys, head dim 128: the 4 groups become the queries,
    # 8 x 1 blocks of 64 queries cannot fill 2 x 132 SM slots, so the keys are split; of the split counts that
    # change the blocks per split (1-8, 11, 16, 32 over 32 blocks of 128 keys), the best wave efficiency is
    # 32 splits' (32 x 8 / 264), and no smaller count reaches 85% of it
    q, k, v = qkv(1, 32, 8, 4096, 128)
    q = q[:, :, :1]
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # no gradient wanted: only the output stays; the logsumexp and RNG state lived with the op
    assert torch.cuda.memory_allocated() - start == rounded(nbytes(out.shape, BF16))
    during = flash_forward_bytes(1, 32, 1, 128, BF16)
    splits = rounded(nbytes((32, 1, 8, 4), torch.float32)) + rounded(nbytes((32, 1, 8, 4, 128), torch.float32))
    assert torch.cuda.max_memory_allocated() - start == during + splits


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_efficient_attention_memory_forward_and_backward():
    b, h, length, d = 2, 4, 100, 64
    f32 = torch.float32
    q, k, v = qkv(b, h, h, length, d, dtype=f32, grad=True)
    before = torch.cuda.memory_allocated()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
    assert out.stride() == (length * h * d, d, h * d, 1)  # written (B, L, H, D)
    # the output, and the logsumexp padded to a multiple of 32 queries for the backward
    kept = rounded(nbytes(out.shape, f32)) + rounded(nbytes((b, h, up(length, 32)), f32))
    assert torch.cuda.memory_allocated() - before == kept
    grad = torch.randn_like(out)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    grads = 3 * rounded(nbytes(q.shape, f32))
    # fp32: delta = (grad_out * out).sum(-1).transpose(-2, -1).contiguous(), its temporaries freed before the
    # kernel's workspace: per (batch, head), 2 blocks of 64 queries x 1 block of 64 dims, each staging 64 x 64
    # floats and 4 words (the 64 x 64 kernel, sm 8.0 list)
    delta = rounded(nbytes((b, h, length), f32))
    temporaries = rounded(nbytes((b, length, h, d), f32)) + rounded(nbytes((b, length, h), f32))
    workspace = rounded(b * h * 2 * 1 * (4 + 64 * 64) * 4)
    peak = grads + delta + max(temporaries, workspace)
    assert torch.cuda.max_memory_allocated() - start == peak
    assert torch.cuda.memory_allocated() - start == grads - rounded(nbytes((b, h, up(length, 32)), f32))


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_cudnn_memory_forward_and_backward_and_without_grad():
    b, hq, hk, length, d = 2, 8, 2, 128, 64
    q, k, v = qkv(b, hq, hk, length, d, grad=True)
    before = torch.cuda.memory_allocated()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductCudnnAttentionBackward0"
    stats = rounded(nbytes((b, hq, length, 1), torch.float32))
    assert torch.cuda.memory_allocated() - before == rounded(nbytes(out.shape, BF16)) + stats
    grad = torch.randn_like(out)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    grads = rounded(nbytes(q.shape, BF16)) + 2 * rounded(nbytes(k.shape, BF16))
    assert torch.cuda.max_memory_allocated() - start == grads  # cuDNN's own workspace is not counted
    # no gradient wanted: the output alone, no softmax stats (flash would have held its logsumexp and RNG state
    # while it ran); inference mode reaches the same backend below autograd
    del out
    for no_grad in (torch.no_grad, torch.inference_mode):
        with no_grad():
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            assert torch.cuda.memory_allocated() - start == rounded(nbytes(out.shape, BF16))
            assert torch.cuda.max_memory_allocated() - start == rounded(nbytes(out.shape, BF16))
            del out


@distributed_test(world_size=[2], device="cuda", gpu="H100", shapes_only=True)
def test_llama3_8b_attention_at_8k_fits_as_on_an_h100():
    # one layer's attention of Llama-3-8B at 8192 tokens, forward and backward: 32 query heads on 8 key/value heads
    b, hq, hk, length, d = 1, 32, 8, 8192, 128
    peaks = {}
    for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        q, k, v = qkv(b, hq, hk, length, d, grad=True)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.randn_like(out))
        peaks[backend] = torch.cuda.max_memory_allocated() - start
        del q, k, v, out
    fwd = flash_forward_bytes(b, hq, length, d, BF16)
    assert peaks[SDPBackend.FLASH_ATTENTION] == fwd + rounded(nbytes((b, length, hq, d), BF16)) + flash_backward_bytes(
        b, hq, hk, length, d, BF16
    )
    assert peaks[SDPBackend.MATH] - peaks[SDPBackend.FLASH_ATTENTION] > 8 * GiB  # the (L x L) scores per head
    assert peaks[None] < peaks[SDPBackend.FLASH_ATTENTION]  # cuDNN first on an H100 (its workspace not counted)


@distributed_test(world_size=[2], device="cuda", gpu="H100")
def test_compiled_flex_attention_takes_its_kernels_memory():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, hq, hk, length, d = 2, 8, 2, 256, 64
    q, k, v = qkv(b, hq, hk, length, d)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, length, length, device="cuda")
    compiled = torch.compile(flex_attention)
    compiled(q, k, v, block_mask=mask, enable_gqa=True)  # the first call compiles (its result dropped at once)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = compiled(q, k, v, block_mask=mask, enable_gqa=True)
    assert out.stride() == q.stride()  # laid out as the query
    # the kernel writes the output, the logsumexp and the row maxima (B, Hq, L) fp32; no (L x L) scores
    rows = rounded(nbytes((b, hq, length), torch.float32))
    assert torch.cuda.max_memory_allocated() - start == rounded(nbytes(out.shape, BF16)) + 2 * rows
    assert torch.cuda.memory_allocated() - start == rounded(nbytes(out.shape, BF16))
    expected = reference(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)
