"""Which kernel `scaled_dot_product_attention` runs on a CUDA card, chosen by the rules torch 2.13 follows.

On a GPU, torch picks one of four backends for each call (`select_sdp_backend` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, over checks shared with the CPU in
sdp_utils_cpp.h): it walks the priority order and takes the first backend whose checks all
pass. The checks look at the card (compute capability), the inputs (dtype, head dims,
shapes, strides, storage offsets, nested or dense), the call (mask, dropout, causal,
grouped-query attention, gradients wanted) and the switches users set
(`torch.backends.cuda.enable_*_sdp`, `torch.nn.attention.sdpa_kernel`, which set the same
global flags on a CPU build). This module answers with the same rules for the card a rank
simulates, so the simulated run takes the backend, the memory and the errors of the real one.

What the rules are, in short (2.13; each check is one function below, in torch's order):

* flash: sm 8.0-12.1; fp16/bf16; q, k, v head dims equal and at most 256; no mask; causal
  only with equal query and key lengths; grouped-query attention (`enable_gqa`, k/v heads
  dividing q heads, k and v heads equal); last dims contiguous; for training on sm 8.6-8.9
  and 12.x, head dim at most 192, or above 224 without dropout.
* memory-efficient: sm 5.0-12.1; fp16/fp32 (and bf16 from sm 8.0); head dims multiples of
  the GEMM alignment (8 for 16-bit types, 4 for fp32 from sm 8.0); storage offsets aligned;
  masks of any broadcastable shape; no grouped-query attention (q, k, v heads equal).
* cuDNN: sm 8.0-12.1; fp16/bf16; masks of shape (L, S) or (B|1, H|1, L, S) that need no
  gradient; dropout a multiple of 1/16; head dims multiples of 8 and at most 128 (192/128
  on sm 9.0 and 10.x); key length not 1; grouped-query attention with any k and v heads
  dividing q's; not under deterministic algorithms.
* order: flash, efficient, math, cuDNN, except on sm 9.x and 10.x, where torch (with the
  cuDNN its wheels ship, above 9.15) puts cuDNN first at the process's first attention,
  unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``; `sdpa_kernel(..., set_priority=True)`
  reorders.
* none usable: a warning per fused backend saying why, then "No available kernel.
  Aborting execution."; all four switched off: "No viable backend ..."; math off while
  the overrideable backend is on (`enable_math_sdp(False)` alone): "Invalid backend".

Torch's FA3 path (opt-in on sm 9.0) is not modelled: it is off unless activated.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence

import torch

from accel.sim.core import torch_internals

#: torch's `SDPBackend` values
MATH, FLASH, EFFICIENT, CUDNN, OVERRIDEABLE = 0, 1, 2, 3, 4
NAMES = {MATH: "math", FLASH: "flash", EFFICIENT: "efficient", CUDNN: "cudnn", OVERRIDEABLE: "overrideable"}
#: the order torch starts with, and the one it switches to on cards that prefer cuDNN
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN, OVERRIDEABLE)
CUDNN_FIRST = (CUDNN, FLASH, EFFICIENT, MATH)
#: the cuDNN a simulated card runs: the one torch 2.13's CUDA wheels ship (9.19), as `cudnnGetVersion` reports it
CUDNN_VERSION = 91900
#: the environment variable that keeps cuDNN out of first place (read once per process, as torch does)
DEPRIORITIZE_ENV = "TORCH_CUDNN_SDPA_DEPRIORITIZED"
NESTED_ENV = "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED"

_HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Card:
    """The figures of a card the choice depends on."""

    major: int
    minor: int

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


@dataclasses.dataclass(frozen=True)
class Call:
    """One `scaled_dot_product_attention` call, as the checks see it (`sdp_params`)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.query, self.key, self.value)

    @property
    def wants_grad(self) -> bool:
        """Whether autograd will ask for gradients of q, k or v (`input_requires_grad`)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.tensors)

    @property
    def any_nested(self) -> bool:
        # nested inputs of the strided layout (`has_for_nested_inputs`)
        return any(t.is_nested and t.layout is torch.strided for t in self.tensors)

    @property
    def all_dense(self) -> bool:
        return not any(t.is_nested for t in self.tensors)


#: a check: None when it passes, else the reason it gives (torch's warning, when it warns)
Check = Callable[[Call, Card], "str | None"]


class Silent(str):
    """A failing check torch reports without a warning."""


# -- the flags users set ---------------------------------------------------------------------------


def enabled() -> dict[int, bool]:
    """The global switches (`enable_*_sdp`, `sdpa_kernel`), as the C++ context holds them."""
    return {
        MATH: torch.backends.cuda.math_sdp_enabled(),
        FLASH: torch.backends.cuda.flash_sdp_enabled(),
        EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled(),
        CUDNN: torch.backends.cuda.cudnn_sdp_enabled(),
        OVERRIDEABLE: _overrideable_enabled(),
    }


def _overrideable_enabled() -> bool:
    return torch_internals.overrideable_sdp_enabled()


def _priority() -> list[int]:
    return torch_internals.sdp_priority_order()


def _set_priority(order: Sequence[int]) -> None:
    torch_internals.set_sdp_priority_order(list(order))


#: [whether cuDNN goes first in this process's life, whether it was put first]; empty until its first attention
_life: list[bool] = []


def new_life() -> None:
    """The process starts a new life (a simulated rank's next test): switches and order as a fresh process has them."""
    torch_internals.restore_sdp_switches(list(DEFAULT_ORDER))
    _life.clear()


def prefers_cudnn(card: Card, env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether torch puts cuDNN first on `card` (`check_prefer_cudnn_attention`).

    cuDNN newer than 9.15 on sm 9.x or 10.x (CUDA 13 builds; CUDA 12 builds also ask for
    minor 0 or 3, which every such card here has), unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``.
    """
    if env.get(DEPRIORITIZE_ENV) == "1":
        return False
    return CUDNN_VERSION > 91500 and card.major in (9, 10)


def priority_order(card: Card) -> list[int]:
    """The order backends are tried in: on cards that prefer cuDNN, put first once per process, as torch does.

    Torch sets the order once, before the process's first attention or its first look at
    the order (`sdpa_kernel(set_priority=True)` reads it to restore it later); a CPU build
    sets nothing, so an order found changed here was set by such a context, after torch
    would have put cuDNN first: it is left as it is, and cuDNN goes first when the context
    gives torch's default back.
    """
    if not _life:
        _life[:] = [prefers_cudnn(card), False]
    if _life[0] and not _life[1] and tuple(_priority()) == DEFAULT_ORDER:
        _set_priority(CUDNN_FIRST + (OVERRIDEABLE,))
        _life[1] = True
    return _priority()


# -- checks shared by the fused backends (sdp_utils_cpp.h) --------------------------------------------


def _shapes_4d(call: Call, card: Card) -> str | None:
    dims = [t.dim() for t in call.tensors]
    if dims == [4, 4, 4]:
        return None
    return (
        "All fused kernels requires query, key and value to be 4 dimensional, but got "
        f"Query dim: {dims[0]}, Key dim: {dims[1]}, Value dim: {dims[2]} instead."
    )


def _no_mask(call: Call, card: Card) -> str | None:
    return None if call.attn_mask is None else "Flash attention does not support non-null attn_mask."


def _mask_shape(call: Call, card: Card) -> str | None:
    """A mask of shape (L, S) or (B|1, H|1, L, S) that needs no gradient (`check_attn_mask_shape`)."""
    mask = call.attn_mask
    if mask is None:
        return None
    if mask.requires_grad:
        return Silent("the mask requires grad")
    q, k = call.query, call.key
    fits = mask.dim() >= 2 and _fits(mask.shape[-2], q.shape[2]) and _fits(mask.shape[-1], k.shape[2])
    if fits and mask.dim() == 2:
        return None
    if fits and mask.dim() == 4 and _fits(mask.shape[0], q.shape[0]) and _fits(mask.shape[1], q.shape[1]):
        return None
    return (
        "Please use the following attn mask shapes: 2d - ({Q_seq_len, 1}  x {KV_seq_len, 1}); "
        "4d - ({Batch, 1} x {Num_heads, 1} x {Q_seq_len, 1}  x {KV_seq_len, 1})"
    )


def _fits(mask_size: int, size: int) -> bool:
    return mask_size == size or mask_size == 1


def _sizes(t: torch.Tensor) -> str:
    return f"[{', '.join(str(s) for s in t.shape)}]"


def _batch_and_heads(gqa: bool, same_kv_heads: bool = True) -> Check:
    """Equal batch sizes; equal head counts, or grouped-query heads where the backend takes them."""

    def check(call: Call, card: Card) -> str | None:
        q, k, v = call.tensors
        if not q.shape[0] == k.shape[0] == v.shape[0]:
            return (
                "For dense inputs, both fused kernels require query, key and value to have the same "
                f"batch_size. Query.sizes(): {_sizes(q)}, Key.sizes(): {_sizes(k)}, Value.sizes(): {_sizes(v)} "
                "instead. To broadcast dense inputs, try using unsqueeze and expand_to before passing them "
                "into the kernel."
            )
        if call.enable_gqa and gqa:
            return _grouped_heads(call, same_kv_heads)
        if q.shape[-3] == k.shape[-3] == v.shape[-3]:
            return None
        return (
            "For dense input, both fused kernels require query, key and value to have the same num_heads. "
            f"Query.sizes(): {_sizes(q)}, Key sizes(): {_sizes(k)}, Value sizes(): {_sizes(v)} instead. To "
            "broadcast dense inputs, try using unsqueeze and expand_to before passing them into the kernel."
        )

    return check


def _grouped_heads(call: Call, same_kv_heads: bool) -> str | None:
    q, k, v = (t.shape[-3] for t in call.tensors)
    if same_kv_heads and k != v:
        return (
            "Both fused kernels require key and value to have the same num_heads and batch_size but got: "
            f"Key sizes: {_sizes(call.key)}, Value sizes: {_sizes(call.value)}, Query sizes: "
            f"{_sizes(call.query)} instead."
        )
    if q % k != 0 or (not same_kv_heads and q % v != 0):
        return (
            "The number of heads in key/value must divide number of heads in query.Got input Key sizes(): "
            f"{k}, Value sizes(): {v}, Query sizes(): {q} instead."
        )
    return None


def _nonzero_lengths(call: Call, card: Card) -> str | None:
    if call.query.shape[-2] == 0 or call.key.shape[-2] == 0:
        return "All fused kernels do not support zero seq_len_q or seq_len_kv."
    return None


def _last_dim_contiguous(ignore_singleton: bool) -> Check:
    """Last dims of stride 1 (a head dim of 1 excepted where the backend pads it), the mask's too."""

    def check(call: Call, card: Card) -> str | None:
        ok = all(t.stride(-1) == 1 for t in call.tensors)
        ok = ok or (ignore_singleton and call.query.shape[-1] == 1)
        mask = call.attn_mask
        if ok and (mask is None or mask.stride(-1) == 1):
            return None
        q, k, v = call.tensors
        text = (
            "All fused kernels require the last dimension of the input to have stride 1. Got Query.stride(-1): "
            f"{q.stride(-1)}, Key.stride(-1): {k.stride(-1)}, Value.stride(-1): {v.stride(-1)}"
        )
        if mask is not None:
            text += (
                f", Attn_mask.stride(-1): {mask.stride(-1)} (GPU backends require attn_mask's last dimension "
                "to have stride 1 while the CPU does not)."
            )
        return text

    return check


def _dtypes(allowed: tuple[torch.dtype, ...], call: Call) -> str | None:
    q, k, v = call.tensors
    if q.dtype == k.dtype == v.dtype and q.dtype in allowed:
        return None
    names = ", ".join(_c10_name(d) for d in allowed)
    return (
        f"Expected query, key and value to all be of dtype: {{{names}}}. Got Query dtype: {_c10_name(q.dtype)}, "
        f"Key dtype: {_c10_name(k.dtype)}, and Value dtype: {_c10_name(v.dtype)} instead."
    )


def _c10_name(dtype: torch.dtype) -> str:
    # how c10 prints a dtype in these messages
    return {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def _sm_range(name: str, low: tuple[int, int], high: tuple[int, int]) -> Check:
    def check(call: Call, card: Card) -> str | None:
        if low <= card.capability <= high:
            return None
        return (
            f"{name} only supports gpu architectures in the range [sm{low[0]}{low[1]}, sm{high[0]}{high[1]}]. "
            f"Attempting to run on a sm {card.major}.{card.minor} gpu."
        )

    return check


def _switch(backend: int, text: str) -> Check:
    def check(call: Call, card: Card) -> str | None:
        return None if enabled()[backend] else text

    return check


# -- nested (strided layout) inputs --------------------------------------------------------------------


def _nested_batch(call: Call, card: Card) -> str | None:
    """Batch sizes equal, or broadcast (size 1) when no gradient is wanted (`check_batch_size_nested`)."""
    return _broadcast(call, [t.size(0) for t in call.tensors], "batch sizegot Query batch size", "Key batch size")


def _nested_lengths(call: Call, card: Card) -> str | None:
    """No ragged head counts, no empty sequence; heads equal or broadcast (`check_for_seq_len_0_nested_tensor`)."""
    heads = []
    for name, t in zip(("query ", "key ", "value "), call.tensors, strict=True):
        if not t.is_nested:
            heads.append(t.size(1))
            continue
        parts = t.unbind()
        if len({p.shape[0] for p in parts}) > 1:
            return f"Fused kernels do not support ragged num_head_dims, {name}has a ragged num_heads."
        if any(p.shape[1] == 0 for p in parts):
            return f"Fused kernels do not support seq_len == 0, {name}has a seq len of 0."
        heads.append(parts[0].shape[0] if parts else 0)
    return _broadcast(call, heads, "num heads got Query num heads", "Key num heads")


def _broadcast(call: Call, sizes: list[int], what: str, key: str) -> str | None:
    """Sizes of q, k, v equal, or broadcast (1) without gradients; torch's words otherwise (`what`, `key`)."""
    if len(set(sizes)) == 1:
        return None
    if call.wants_grad:
        return "Both fused kernels do not support training with broadcasted NT inputs."
    if any(size not in (max(sizes), 1) for size in sizes):
        value = key.replace("Key", "Value")
        return (
            f"Both fused kernels require query, key and value to have broadcastable {what} {sizes[0]}, "
            f"{key} {sizes[1]}, {value} {sizes[2]} instead."
        )
    return None


def _flash_nested_head_dim(call: Call, card: Card) -> str | None:
    d = [t.size(-1) for t in call.tensors]
    if d[0] == d[1] == d[2] and d[0] % 8 == 0 and d[0] <= 256:
        return None
    return (
        "For NestedTensor inputs, Flash attention requires q,k,v to have the same last dimension and to be a "
        f"multiple of 8 and less than or equal to 256. Got Query.size(-1): {d[0]}, Key.size(-1): {d[1]}, "
        f"Value.size(-1): {d[2]} instead."
    )


def _efficient_nested_grad(call: Call, card: Card) -> str | None:
    if call.wants_grad:
        return "Memory efficient attention currently doesn't support training with NT inputs."
    return None


# -- flash (can_use_flash_attention) --------------------------------------------------------------------


def _flash_head_dim(call: Call, card: Card) -> str | None:
    d = [t.size(-1) for t in call.tensors]
    if d[0] == d[1] == d[2] and d[0] <= 256:
        return None
    return (
        "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. "
        f"Got Query.size(-1): {d[0]}, Key.size(-1): {d[1]}, Value.size(-1): {d[2]} instead."
    )


def _flash_training_head_dim(call: Call, card: Card) -> str | None:
    """On sm 8.6-8.9 and 12.x the backward lacks head dims in (192, 224], and above 224 with dropout."""
    consumer = (8, 6) <= card.capability <= (8, 9) or (12, 0) <= card.capability <= (12, 1)
    if not (call.wants_grad and consumer):
        return None
    d = call.query.size(-1)
    if d <= 192 or (not call.dropout_p > 0.0 and d > 224):
        return None
    return (
        "Flash attention currently doesn't support training with head_dim ∈ (192, 224] or (head_dim ∈ (224, 256] "
        "and dropout > 0.0) on gpu architectures in the range[sm86, sm89].Attempting to run with dropout set to: "
        f"{call.dropout_p}and head_dim: {d} on a sm {card.major}.{card.minor} gpu."
    )


def _flash_causal_square(call: Call, card: Card) -> str | None:
    q, k = call.query, call.key
    if not call.is_causal or q.is_nested or k.is_nested or q.shape[-2] == k.shape[-2]:
        return None
    return (
        "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. Got seqlen_q: "
        f"{q.shape[-2]} seqlen_k: {k.shape[-2]}. If you would like to use causal attention with non-square masks, "
        "please see CausalAttnMask."
    )


def _flash_dtypes(call: Call, card: Card) -> str | None:
    return _dtypes(_HALF if card.major >= 8 else (torch.float16,), call)


FLASH_CHECKS: tuple[Check, ...] = (
    _switch(FLASH, "Flash attention has been runtime disabled."),
    _shapes_4d,
    _no_mask,
    _flash_head_dim,
    _sm_range("Flash attention", (8, 0), (12, 1)),
    _flash_training_head_dim,
    _flash_causal_square,
    _flash_dtypes,
)
FLASH_NESTED: tuple[Check, ...] = (_nested_batch, _flash_nested_head_dim, _nested_lengths)
FLASH_DENSE: tuple[Check, ...] = (_batch_and_heads(gqa=True), _nonzero_lengths, _last_dim_contiguous(True))


# -- memory-efficient (can_use_mem_efficient_attention) -------------------------------------------------


def gemm_alignment(dtype: torch.dtype, card: Card) -> int:
    """Elements the CUTLASS kernels need head dims (and offsets) to be multiples of (`minimum_gemm_alignment`)."""
    half = dtype in _HALF
    tensor_cores = card.major >= 8 or (card.major >= 7 and half)
    alignment = 4 if card.major >= 8 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def _efficient_head_dim(call: Call, card: Card) -> str | None:
    q, k, v = (t.size(-1) for t in call.tensors)
    align = gemm_alignment(call.query.dtype, card)
    if q == k and q % align == 0 and q > 0 and v % align == 0 and v > 0:
        return None
    return (
        f"Mem efficient attention requires last dimension of inputs to be divisible by {align}. Got Query.size(-1): "
        f"{q}, Key.size(-1): {k}, Value.size(-1): {v} instead."
    )


def _efficient_offsets(call: Call, card: Card) -> str | None:
    """From sm 8.0, byte offsets aligned to the GEMM alignment (`check_data_ptr_alignment_mem_efficient`)."""
    if not call.all_dense or card.major < 8:
        return None
    size = call.query.element_size()
    align = gemm_alignment(call.query.dtype, card) * size
    offsets = [t.storage_offset() * size for t in call.tensors]
    if all(t.numel() == 0 or off % align == 0 for t, off in zip(call.tensors, offsets, strict=True)):
        return None
    q, k, v = (off % align for off in offsets)
    return (
        "Mem efficient attention on sm80 or newer requires q, k, and v storage offsets * element_size to be "
        f"aligned to {align} bytes. Got query.storage_offset() * element_size % alignment_bytes: {q}, "
        f"key.storage_offset() * element_size % alignment_bytes: {k}, value.storage_offset() * element_size % "
        f"alignment_bytes: {v}."
    )


def _efficient_dtypes(call: Call, card: Card) -> str | None:
    allowed = (torch.float16, torch.float32, torch.bfloat16) if card.major >= 8 else (torch.float16, torch.float32)
    return _dtypes(allowed, call)


EFFICIENT_CHECKS: tuple[Check, ...] = (
    _switch(EFFICIENT, "Memory Efficient attention has been runtime disabled."),
    _sm_range("Mem Efficient Attention", (5, 0), (12, 1)),
    _shapes_4d,
    _efficient_head_dim,
    _efficient_offsets,
)
EFFICIENT_NESTED: tuple[Check, ...] = (_efficient_nested_grad, _nested_batch, _nested_lengths)
# torch 2.13's CUDA build runs no grouped-query attention here (heads must match)
EFFICIENT_DENSE: tuple[Check, ...] = (_nonzero_lengths, _last_dim_contiguous(False), _batch_and_heads(gqa=False))
EFFICIENT_LAST: tuple[Check, ...] = (_efficient_dtypes,)


# -- cuDNN (can_use_cudnn_attention) --------------------------------------------------------------------


def cudnn_head_dim_limit(card: Card, d_qk: int, d_v: int) -> int:
    """The largest head dim cuDNN takes: 128; 256 on sm 9.0/10.x from cuDNN 9.22; (192, 128) there from 9.11."""
    sm90_or_10x = card.capability == (9, 0) or card.major == 10
    old_sm107 = card.capability == (10, 7) and CUDNN_VERSION <= 92500
    if sm90_or_10x and not old_sm107 and CUDNN_VERSION > 92200:
        return 256
    if sm90_or_10x and CUDNN_VERSION >= 91100 and d_qk == 192 and d_v == 128:
        return 192
    return 128


def _cudnn_shapes(call: Call, card: Card) -> str | None:
    """Batch and heads below 65536, head dims multiples of 8 within the limit, a key length other than 1."""
    q, k, v = call.tensors
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return (
            "cuDNN SDPA does not support batch size or num_heads greater than 65535. Got batch size: "
            f"{q.shape[0]}, num_heads: {q.shape[1]}"
        )
    d_qk, d_v = q.shape[3], v.shape[3]
    limit = cudnn_head_dim_limit(card, d_qk, d_v)
    if d_qk > limit or d_v > limit:
        return f"head_dim should be no more than {limit}"
    if d_qk % 8 or d_v % 8:
        return "head_dim should be a multiple of 8"
    if k.shape[2] == 1:
        return "cudnn SDPA does not support key/value sequence length 1."
    if call.dropout_p != 0.0 and q.shape[2] == 1:
        return "cudnn SDPA does not support query sequence length 1 with dropout."
    return None


def _cudnn_nested(call: Call, card: Card) -> str | None:
    if not call.any_nested:
        return None
    if os.environ.get(NESTED_ENV) != "1":
        return "Experimental cuDNN SDPA nested tensor support is not enabled."
    if card.major not in (9, 10):
        return "cuDNN SDPA supports nested tensors on SM 9.0, SM 10.0."
    return None


def _cudnn_nested_query_length(call: Call, card: Card) -> str | None:
    if not call.query.is_nested:
        return None
    if max(part.shape[1] for part in call.query.unbind()) <= 128:
        return "cuDNN attention does not support nested tensor query sequence length <= 128."
    return None


def _cudnn_deterministic(call: Call, card: Card) -> str | None:
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return "cuDNN SDPA is not deterministic."
    return None


def _cudnn_dropout(call: Call, card: Card) -> str | None:
    if float(call.dropout_p * 16.0).is_integer():
        return None
    return (
        "cuDNN dropout probability resolution is limited to 1/16.Use a dropout probability that is a multiple of "
        "1/16 to select the cuDNN backend"
    )


def _cudnn_version_dropout(call: Call, card: Card) -> str | None:
    if call.dropout_p > 0.0 and 91100 < CUDNN_VERSION < 91400:
        return f"{CUDNN_VERSION} cuDNN version does not support droppout in SDPA (9.11 - 9.13)."
    return None


def _cudnn_backward_head_dims(call: Call, card: Card) -> str | None:
    """Where cuDNN takes head dim 256, its backward takes only (<=128, <=128), (192, 128) and (256, 256)."""
    if not call.wants_grad or cudnn_head_dim_limit(card, 0, 0) != 256:
        return None
    d_qk, d_v = call.query.shape[3], call.value.shape[3]
    if (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256)):
        return None
    return (
        f"cuDNN SDPA on SM 9.0/10.x does not support backward with these head dimensions. Got d_qk: {d_qk}, d_v: {d_v}"
    )


CUDNN_CHECKS: tuple[Check, ...] = (
    _cudnn_version_dropout,
    _switch(CUDNN, "cuDNN attention has been runtime disabled."),
    _cudnn_nested,
    _shapes_4d,
    _cudnn_deterministic,
    _flash_dtypes,  # fp16/bf16 from sm 8.0, fp16 before (`check_dtypes_low_precision`)
    _mask_shape,
    _sm_range("cuDNN MHA", (8, 0), (12, 1)),
    _cudnn_dropout,
)
CUDNN_DENSE: tuple[Check, ...] = (
    _nonzero_lengths,
    _last_dim_contiguous(True),
    _batch_and_heads(gqa=True, same_kv_heads=False),
    _cudnn_shapes,
    _cudnn_backward_head_dims,
)
CUDNN_NESTED: tuple[Check, ...] = (_cudnn_nested_query_length,)


# -- the choice (select_sdp_backend) -----------------------------------------------------------------------

#: each fused backend's checks: those for any input, for nested inputs, for dense inputs, and last
_CHECKS: dict[int, tuple[tuple[Check, ...], tuple[Check, ...], tuple[Check, ...], tuple[Check, ...]]] = {
    FLASH: (FLASH_CHECKS, FLASH_NESTED, FLASH_DENSE, ()),
    EFFICIENT: (EFFICIENT_CHECKS, EFFICIENT_NESTED, EFFICIENT_DENSE, EFFICIENT_LAST),
    CUDNN: (CUDNN_CHECKS, CUDNN_NESTED, CUDNN_DENSE, ()),
}


def why_not(backend: int, call: Call, card: Card) -> str | None:
    """Why fused `backend` cannot run `call` on `card` (the first failing check's reason), or None if it can."""
    general, nested, dense, last = _CHECKS[backend]
    checks = general + (nested if call.any_nested else ()) + (dense if call.all_dense else ()) + last
    for check in checks:
        reason = check(call, card)
        if reason is not None:
            return reason
    return None


def choose(call: Call, card: Card) -> int:
    """The backend torch runs `call` with on `card`; raises torch's errors when none may.

    The first backend of the priority order that is switched on and whose checks pass. When
    none is, torch warns why each fused backend was not used and fails.
    """
    flags = enabled()
    if not any(flags[b] for b in (MATH, FLASH, EFFICIENT, CUDNN)):
        raise RuntimeError(
            "No viable backend for scaled_dot_product_attention was found. This is likely due to turning off "
            "both the math kernel and the fused kernels."
        )
    for backend in priority_order(card):
        if backend == OVERRIDEABLE:
            if flags[OVERRIDEABLE]:
                raise RuntimeError("Invalid backend")
        elif backend == MATH:
            if flags[MATH]:
                return MATH
        elif why_not(backend, call, card) is None:
            return backend
    for backend, heading in (
        (EFFICIENT, "Memory efficient kernel not used because:"),
        (FLASH, "Flash attention kernel not used because:"),
        (CUDNN, "cuDNN attention kernel not used because:"),
    ):
        warnings.warn(heading, UserWarning, stacklevel=3)
        reason = why_not(backend, call, card)
        if reason is not None and not isinstance(reason, Silent):
            warnings.warn(reason, UserWarning, stacklevel=3)
    raise RuntimeError("No available kernel. Aborting execution.")
