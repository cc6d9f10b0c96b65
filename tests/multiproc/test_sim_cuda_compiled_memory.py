"""The memory of compiled regions on simulated GPUs, as Inductor's kernels hold it (accel/sim/core/compiled_buffers.py).

A compiled region keeps what Inductor's partitioner saves for backward, and the intermediates
Inductor fuses take no memory; regions the model does not cover are counted as eager code.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from accel.sim.core import compiled_buffers
from harness import distributed_test

MiB = 1 << 20
VOCAB, TOKENS, HIDDEN = 32000, 2048, 64
LOGITS_BF16 = VOCAB * TOKENS * 2  # 125 MiB; in float32 250 MiB


def _loss_step(compiled):
    """One step of an output projection and a cross-entropy in float32 (as LLM trainers compute the loss)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16)

    def loss_fn(x, y):
        return F.cross_entropy(head(x).float(), y)

    step = torch.compile(loss_fn) if compiled else loss_fn
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    step(x, y).backward()  # compiles (when compiled): its memory is not the step's
    head.weight.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step(x, y)
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    return held, peak, loss.item(), head.weight.grad.float().cpu()


@distributed_test(world_size=[2], device="cuda", timeout=240)  # bf16 products of 2048 x 32000 on host cores
def test_a_compiled_loss_holds_what_inductors_partitioner_saves_not_the_float32_logits(rank):
    eager_held, eager_peak, eager_loss, eager_grad = _loss_step(compiled=False)
    held, peak, loss, grad = _loss_step(compiled=True)
    # eager autograd keeps log_softmax's float32 output for backward; Inductor's partitioner saves the
    # bfloat16 logits (and two per-row statistics) and recomputes the rest in its fused backward kernel
    assert 2 * LOGITS_BF16 <= eager_held <= 2 * LOGITS_BF16 + MiB
    assert LOGITS_BF16 <= held <= LOGITS_BF16 + 2 * MiB
    # the float32 upcast, log-softmax and their gradients are fused: never a buffer
    assert eager_peak >= 5 * LOGITS_BF16 and peak <= 2 * LOGITS_BF16 + 8 * MiB, (eager_peak, peak)
    assert abs(loss - eager_loss) < 1e-4
    torch.testing.assert_close(grad, eager_grad, atol=1e-3, rtol=1e-2)


def _positions_step(compiled):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(4096, 1024, device="cuda")

    def f(x):
        positions = torch.arange(x.shape[0], device=x.device)  # made on the device inside the compiled region
        return (x + embedding(positions)).sigmoid().mul(2).sin().mean()

    step = torch.compile(f) if compiled else f
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    step(x).backward()
    base = torch.cuda.memory_allocated()
    loss = step(x)
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    return held, loss.item()


@distributed_test(world_size=[2], device="cuda")
def test_a_region_that_makes_tensors_on_the_device_is_modelled(rank):
    eager_held, eager_loss = _positions_step(compiled=False)
    held, loss = _positions_step(compiled=True)
    assert compiled_buffers.fallbacks == []
    # eager keeps sigmoid's output and sin's input (16 MiB each); Inductor's partitioner recomputes the
    # pointwise chain from the region's inputs in its backward kernel
    assert eager_held >= 32 * MiB and held <= 16 * MiB + MiB, (eager_held, held)
    assert abs(loss - eager_loss) < 1e-6


def _checkpointed_step(compiled):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    up, down = torch.nn.Linear(256, 1024).cuda(), torch.nn.Linear(1024, 256).cuda()

    def block(x):
        return down(up(x).sigmoid().mul(2).sin())

    def f(x):
        return checkpoint(block, x, use_reentrant=False).square().mean()

    step = torch.compile(f) if compiled else f
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    step(x).backward()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(x).backward()
    return torch.cuda.max_memory_allocated() - base


@distributed_test(world_size=[2], device="cuda")
def test_a_checkpointed_region_is_counted_as_eager_code(rank):
    # activation checkpointing is a region the model does not cover: its graph runs op by op, counted so
    assert _checkpointed_step(compiled=True) == _checkpointed_step(compiled=False)


@distributed_test(world_size=[2], device="cuda")
def test_checkpointed_regions_are_modelled_when_asked(rank):
    import os

    eager = _checkpointed_step(compiled=False)
    os.environ[compiled_buffers.CHECKPOINTS_ENV] = "inductor"
    try:
        torch._dynamo.reset()
        modelled = _checkpointed_step(compiled=True)
    finally:
        del os.environ[compiled_buffers.CHECKPOINTS_ENV]
    assert compiled_buffers.fallbacks == []
    # the recomputed block's pointwise chain is fused: Inductor's backward holds less than eager recomputation
    assert modelled < eager, (modelled, eager)


def test_a_bad_checkpoints_setting_is_refused(monkeypatch):
    monkeypatch.setenv(compiled_buffers.CHECKPOINTS_ENV, "fast")
    with pytest.raises(ValueError, match="ACCEL_SIM_COMPILED_CHECKPOINTS='fast': use 'eager'"):
        compiled_buffers.covered(fx.symbolic_trace(lambda x: torch.sin(x)))


def test_inductor_keeps_extern_results_their_inputs_reductions_and_outputs_not_fused_intermediates():
    from torch.fx.experimental.proxy_tensor import make_fx

    def region(x, w):
        scores = torch.mm(x.float().exp() * 2, w)  # the mm's input (the fused exp * 2) is written once
        return scores.relu().sum(1), scores.sigmoid().neg()

    graph = make_fx(region)(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 16)).graph
    kept = {str(node.target) for node in compiled_buffers.kept_buffers(graph)}
    assert kept == {"aten.mul.Tensor", "aten.mm.default", "aten.sum.dim_IntList", "aten.neg.default"}, kept


def _made_on(device):
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, graph.call_function(torch.ones, (3,), {"device": device}))))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_regions_with_collectives_other_devices_or_higher_order_ops_are_not_covered():
    assert compiled_buffers.covered(fx.symbolic_trace(lambda x: torch.sin(x) * 2))
    assert compiled_buffers.covered(_made_on(torch.device("cpu")))
    # AOTAutograd would make this a plain fake tensor of that device, not a simulated one (the backend first
    # makes such factories `_MadeOnDevice`'s: test_a_region_that_makes_tensors_on_the_device_is_modelled)
    assert not compiled_buffers.covered(_made_on(torch.device("cuda", 0)))
    # a simulated tensor's own move is the simulator's
    assert compiled_buffers.covered(fx.symbolic_trace(lambda x: x.to("cuda:1")))

    graph = fx.Graph()
    reduce = torch.ops._c10d_functional.all_reduce.default
    graph.output(graph.call_function(reduce, (graph.placeholder("x"), "sum", "0")))
    assert not compiled_buffers.covered(fx.GraphModule(torch.nn.Module(), graph))


def test_moves_between_the_device_and_itself_leave_the_joint_graph():
    # the host's copies between a simulated device's own tensors (with and without data) are no op on the
    # card; left in, Inductor's partitioner would not recompute through them
    graph, aten, put = fx.Graph(), torch.ops.aten, torch.ops.prims.device_put.default
    exp = graph.call_function(aten.exp.default, (graph.placeholder("x"),))
    moved = graph.call_function(put, (graph.call_function(put, (exp, torch.device("meta"))), torch.device("cpu")))
    graph.output(graph.call_function(aten.sin.default, (moved,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    compiled_buffers.drop_moves_within_the_device(gm)
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.aten.exp.default, torch.ops.aten.sin.default], targets
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), x.exp().sin())


def _gpt2_step(compiled):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # no dropout: compiled random ops draw in another order, as Inductor's do on the card
    config = GPT2Config(
        n_layer=2, n_embd=256, n_head=4, vocab_size=8000, n_positions=512, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    model = GPT2LMHeadModel(config).cuda()
    step = torch.compile(model) if compiled else model
    ids = torch.randint(0, 8000, (4, 512), device="cuda")
    step(input_ids=ids, labels=ids).loss.backward()  # compiles
    model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step(input_ids=ids, labels=ids)
    held = torch.cuda.memory_allocated() - base
    out.loss.backward()
    return held, torch.cuda.max_memory_allocated() - base, out.loss.item()


@pytest.mark.frameworks
@distributed_test(world_size=[2], device="cuda", timeout=240)  # a GPT-2 step, eager and compiled, on host cores
def test_a_compiled_transformers_gpt2_holds_less_than_eager_as_on_the_card(rank):
    # the whole model and its loss in compiled regions (HF's `labels.to(logits.device)` is the simulator's move)
    eager_held, eager_peak, eager_loss = _gpt2_step(compiled=False)
    held, peak, loss = _gpt2_step(compiled=True)
    assert compiled_buffers.fallbacks == []
    assert held < 0.85 * eager_held and peak < 0.8 * eager_peak, (eager_held, held, eager_peak, peak)
    assert abs(loss - eager_loss) < 1e-4


def _ddp_grads(compiled):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))).cuda()
    ddp = DDP(model, bucket_cap_mb=1)  # a bucket per layer (1 MiB of weights): Dynamo splits the graph
    step = torch.compile(ddp) if compiled else ddp
    x = torch.randn(32, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as nanoGPT's train.py
        loss = step(x).float().square().mean()
    loss.backward()
    return [p.grad.cpu() for p in model.parameters()]


@distributed_test(world_size=[2], device="cuda")
def test_a_ddp_model_that_dynamo_splits_at_its_buckets_compiles_and_trains(rank):
    # nanoGPT's train.py under torchrun: Dynamo's DDP optimizer runs each compiled piece on fake tensors
    # while it compiles; those pieces are counted as eager code
    for compiled, eager in zip(_ddp_grads(compiled=True), _ddp_grads(compiled=False), strict=True):
        torch.testing.assert_close(compiled, eager)
