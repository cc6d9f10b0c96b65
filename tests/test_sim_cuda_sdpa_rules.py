"""The rules by which a card's attention backend is chosen (`accel.sim.cuda.attention.backends`), on their own.

Each asks why a fused backend cannot run a call on a card; the calls are described by
host tensors (the checks read shapes, strides, dtypes, offsets and nesting only).
"""

import pytest
import torch

from accel.sim.cuda.attention import backends as rules
from accel.sim.cuda.attention import kernels

H100, A100, L4, T4 = rules.Card(9, 0), rules.Card(8, 0), rules.Card(8, 9), rules.Card(7, 5)


def call(hq=8, hk=8, length=64, d=64, dtype=torch.bfloat16, **kwargs):
    q = torch.empty(2, hq, length, d, dtype=dtype)
    k = torch.empty(2, hk, length, d, dtype=dtype)
    return rules.Call(q, k, k.clone(), **kwargs)


def test_grouped_query_heads_go_to_flash_and_cudnn_not_to_efficient():
    grouped = call(hq=8, hk=2, enable_gqa=True)
    assert rules.why_not(rules.FLASH, grouped, A100) is None
    assert rules.why_not(rules.CUDNN, grouped, H100) is None
    assert "same num_heads" in rules.why_not(rules.EFFICIENT, grouped, A100)
    uneven = call(hq=8, hk=3, enable_gqa=True)
    assert "must divide number of heads in query" in rules.why_not(rules.FLASH, uneven, A100)
    assert "same num_heads" in rules.why_not(rules.FLASH, call(hq=8, hk=2), A100)  # enable_gqa not given


def test_the_card_decides():
    assert "[sm80, sm121]" in rules.why_not(rules.FLASH, call(dtype=torch.float16), T4)
    assert rules.why_not(rules.EFFICIENT, call(dtype=torch.float16), T4) is None
    assert "c10::Half, float}" in rules.why_not(rules.EFFICIENT, call(), T4)  # no bf16 before sm 8.0
    assert rules.prefers_cudnn(H100, env={}) and not rules.prefers_cudnn(A100, env={})
    assert not rules.prefers_cudnn(H100, env={rules.DEPRIORITIZE_ENV: "1"})
    assert rules.cudnn_head_dim_limit(H100, 192, 128) == 192 and rules.cudnn_head_dim_limit(A100, 192, 128) == 128
    assert rules.why_not(rules.CUDNN, call(d=192), H100) == "head_dim should be no more than 128"


def test_alignments_of_the_memory_efficient_kernels():
    assert [rules.gemm_alignment(dtype, A100) for dtype in (torch.float16, torch.float32)] == [8, 4]
    assert rules.gemm_alignment(torch.float32, T4) == 1 and rules.gemm_alignment(torch.float16, T4) == 8
    packed = torch.empty(2, 64, 3, 8, 20, dtype=torch.float16)  # q, k, v unbound from one projection
    q, k, v = (t.transpose(1, 2) for t in packed.unbind(2))
    assert "divisible by 8" in rules.why_not(rules.EFFICIENT, rules.Call(q, k, v), A100)
    shifted = torch.empty(2 * 8 * 64 * 16 + 4, dtype=torch.float16)[4:].view(2, 8, 64, 16)
    assert "storage offsets" in rules.why_not(rules.EFFICIENT, rules.Call(shifted, shifted, shifted), A100)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_inputs():
    parts = [torch.empty(4, length, 16, dtype=torch.float16) for length in (10, 30)]
    nested = torch.nested.nested_tensor(parts)
    ragged = rules.Call(nested, nested, nested)
    assert rules.why_not(rules.FLASH, ragged, A100) is None
    assert "nested tensor support is not enabled" in rules.why_not(rules.CUDNN, ragged, H100)
    empty = torch.nested.nested_tensor([torch.empty(4, 0, 16, dtype=torch.float16), parts[1]])
    assert "seq_len == 0" in rules.why_not(rules.FLASH, rules.Call(empty, empty, empty), A100)
    training = torch.nested.nested_tensor(parts, requires_grad=True)
    assert "training with NT inputs" in rules.why_not(rules.EFFICIENT, rules.Call(training, training, training), A100)


@pytest.mark.parametrize(
    ("work", "sms", "blocks", "splits"),
    [(256, 216, 64, 1), (8, 264, 32, 32), (8, 216, 1, 1), (48, 216, 64, 4)],
)
def test_flash_split_heuristic(work, sms, blocks, splits):
    # 48 blocks on 216 slots: 4 splits fill 192 (89%), within 85% of the best (22 splits, 98%)
    assert kernels.flash_splits(work, sms, blocks) == splits
