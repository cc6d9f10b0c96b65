"""`torch.compile` on simulated GPUs and TPUs: Dynamo traces as on the device, the graphs run eagerly.

Graph breaks, recompilations and `fullgraph=True` errors come from Dynamo itself, so
they are counted and raised as on a GPU (`torch._dynamo.utils.counters`). Compiled
models train under FSDP2 and tensor parallelism with the losses of the eager run; a
simulated TPU takes `backend="openxla"`.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import distributed_test
from tests.multiproc.test_sim_cuda_fsdp import build, close, ddp_run, loss_of, make_batches, shard, train

SIZES = [2, 4]


def _fresh_counters():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


@distributed_test(world_size=2, device="cuda")
def test_dynamo_asks_no_driver_whether_a_cuda_graph_is_captured(rank):
    # torch 2.14's Dynamo asks before it traces a frame (torch_internals.TORCH_CHANGES): a CUDA build's own
    # function would ask the GPU's driver, a CPU build's raises; no CUDA graph is captured on a simulated GPU
    assert torch.cuda.is_current_stream_capturing() is False
    compiled = torch.compile(lambda x: x * 2, backend="eager")
    assert compiled(torch.ones(2, device="cuda")).tolist() == [2.0, 2.0]


@distributed_test(world_size=[2], device="cuda")
def test_a_compiled_function_traces_the_simulated_tensors_and_gives_eager_results(rank):
    counters = _fresh_counters()

    def f(x, y):
        scale = torch.ones(x.shape[-1], device=x.device) * (2.0 if x.is_cuda else 3.0)  # the GPU's branch
        traced = 1.0 if torch.compiler.is_compiling() else 0.0
        return (x * y).sin() + y.relu() * scale + traced

    compiled = torch.compile(f)
    x = torch.randn(4, 8, device="cuda")
    y = torch.randn(4, 8, device="cuda", requires_grad=True)
    out = compiled(x, y)
    assert out.device == torch.device("cuda", rank) and out.is_cuda
    close(out.detach().cpu(), (f(x, y) + 1).detach().cpu())  # traced: is_compiling() was true
    out.sum().backward()
    assert y.grad is not None and y.grad.device == torch.device("cuda", rank)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    compiled(x, y)
    assert counters["stats"]["unique_graphs"] == 1  # guards hold: no recompilation
    compiled(torch.randn(3, 8, device="cuda"), torch.randn(3, 8, device="cuda"))
    assert counters["stats"]["unique_graphs"] == 2  # a new shape recompiles, as on a GPU


@distributed_test(world_size=[2], device="cuda")
def test_graph_breaks_and_fullgraph_errors_are_dynamos(rank):
    import torch._dynamo

    counters = _fresh_counters()

    def with_a_break(x):
        x = x * 2
        print("a print breaks the graph")
        return x + 1

    x = torch.randn(3, device="cuda")
    out = torch.compile(with_a_break)(x)
    close(out.cpu(), (x * 2 + 1).cpu())
    assert sum(counters["graph_break"].values()) == 1 and counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()  # the cached graphs of with_a_break would serve the next call
    with pytest.raises(torch._dynamo.exc.Unsupported, match="print"):
        torch.compile(with_a_break, fullgraph=True)(x)


@distributed_test(world_size=[2], device="cuda")
def test_compiler_helpers_and_every_backend_and_mode(rank):
    counters = _fresh_counters()

    @torch.compiler.disable
    def eager_only(x):
        assert not torch.compiler.is_compiling()
        return x - 1

    def f(x):
        return eager_only(x * 3) + 1

    x = torch.randn(5, device="cuda")
    for kwargs in (
        {},
        {"mode": "max-autotune"},
        {"mode": "reduce-overhead", "dynamic": True},
        {"backend": "aot_eager"},
        {"backend": "cudagraphs"},
        {"options": {"triton.cudagraphs": True}},
    ):
        torch._dynamo.reset()
        close(torch.compile(f, **kwargs)(x).cpu(), (x * 3).cpu())
    assert counters["graph_break"]  # the disabled function is a break, as on a GPU

    graphs = []

    def my_backend(gm, example_inputs):  # a user's own backend receives the graph and the simulated inputs
        graphs.append([t.device for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    close(torch.compile(lambda t: t.cos() * 2, backend=my_backend)(x).cpu(), (x.cos() * 2).cpu())
    assert graphs and graphs[0] == [torch.device("cuda", rank)]


@distributed_test(world_size=[2], device="cuda")
def test_module_compile_and_a_compiled_optimizer_step_train_as_eager(rank):
    torch.cuda.set_device(rank)
    data = make_batches(rank)
    eager_model = build()
    expected, _ = train(eager_model, data)

    model = build()
    model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @torch.compile(fullgraph=False)
    def step():
        optimizer.step()

    losses = []
    for inputs, targets in data:
        loss = loss_of(model, inputs, targets)
        loss.backward()
        step()
        optimizer.zero_grad()
        losses.append(loss.item())
    close(losses, expected)
    assert all(p.device == torch.device("cuda", rank) for p in model.parameters())


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
@distributed_test(world_size=SIZES, device="cuda")
def test_compiled_blocks_under_fsdp2_train_as_ddp_does(rank, how):
    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, _ = ddp_run(rank, data)
    model = build()
    for index, layer in enumerate(model.layers):  # torchtitan compiles each block, then shards it
        if how == "model.compile":
            layer.compile()
        else:
            model.layers[index] = torch.compile(layer)
    model = shard(model)
    losses, _ = train(model, data)
    close(losses, expected)


@distributed_test(world_size=[2], device="cuda")
def test_a_compiled_tensor_parallel_mlp_gives_the_eager_results(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).cuda()

    reference = mlp()
    model = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = torch.compile(model)
    torch.manual_seed(1)
    x = torch.randn(8, 16, device="cuda")
    close(compiled(x).detach().cpu(), reference(x).detach().cpu())
    compiled(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    close(model[0].weight.grad.full_tensor().cpu(), reference[0].weight.grad.cpu())


@distributed_test(world_size=[2], device="cuda")
def test_compiled_activation_checkpointing_and_flex_attention(rank):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = nn.Linear(8, 8).cuda()
    x = torch.randn(4, 8, device="cuda", requires_grad=True)

    def checkpointed(t):
        return checkpoint(lambda u: F.gelu(layer(u)), t, use_reentrant=False).sum()

    torch.compile(checkpointed)(x).backward()
    compiled_grad = x.grad.clone()
    x.grad = None
    checkpointed(x).backward()
    close(compiled_grad.cpu(), x.grad.cpu())

    q, k, v = (torch.randn(1, 2, 16, 8, device="cuda") for _ in range(3))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = create_block_mask(causal, 1, 1, 16, 16, device="cuda")
    out = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.device == torch.device("cuda", rank)
    close(out.cpu(), expected.cpu(), rtol=1e-4, atol=1e-5)


@distributed_test(world_size=[2], device="xla")
def test_openxla_on_a_simulated_tpu_gives_the_eager_results(rank):
    import torch_xla.core.xla_model as xm

    device = xm.xla_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    x = torch.randn(4, 8, device=device)
    expected = model(x)
    out = torch.compile(model, backend="openxla")(x)
    assert out.device == device
    close(out.detach().cpu(), expected.detach().cpu())
    out.sum().backward()
    assert model[0].weight.grad.device == device


SCRIPT = """
import os

import torch

@torch.compile(mode="max-autotune")  # decorated at import, as torchtitan and DeepSpeed do
def step(x):
    return torch.nn.functional.gelu(x) * 2

@torch.compile
def other(x):
    return x + 1

x = torch.randn(8, device="cuda")
for _ in range(3 if os.environ["RANK"] == "0" else 0):  # rank 1 only decorates: nothing to say
    torch.testing.assert_close(step(x), torch.nn.functional.gelu(x) * 2)
    other(x)
print("trained")
"""


def test_a_run_says_once_per_process_how_it_compiles_at_its_first_compile(tmp_path):
    (tmp_path / "compiled.py").write_text(textwrap.dedent(SCRIPT))
    accel = str(Path(sys.executable).with_name("accel"))
    args = [accel, "launch", "--simulate", "cuda", "--num_processes", "2", "compiled.py"]
    run = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("trained") == 2
    said = [line for line in run.stderr.splitlines() if "torch.compile traces with Dynamo" in line]
    assert len(said) == 1 and said[0].startswith("[rank 0]"), run.stderr
    assert "'inductor'" in said[0]


# -- flex attention with gradients (torchtitan's attention type "flex") --------------------------------


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@distributed_test(world_size=[2], device="cuda")
def test_flex_attention_backward_compiled_and_eager_gives_the_gradients_of_sdpa(rank):
    # Flex attention differentiates its score_mod on fake tensors while Dynamo traces, and again when it
    # runs: fake CUDA tensors that need gradients would abort the rank (a CPU build has no CUDA device guard)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 16, device="cuda", requires_grad=True) for _ in range(3))
    mask = create_block_mask(_causal, 1, 1, 128, 128, device="cuda")
    compiled = torch.compile(flex_attention)
    grads = {}
    for name, attend in (("compiled", compiled), ("eager", flex_attention), ("sdpa", None)):
        out = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if attend is None
            else attend(q, k, v, block_mask=mask)
        )
        assert out.device == torch.device("cuda", rank)
        out.pow(2).sum().backward()
        assert all(t.grad.device == torch.device("cuda", rank) for t in (q, k, v))
        grads[name] = [t.grad.cpu() for t in (q, k, v)]
        q.grad = k.grad = v.grad = None
    for name in ("eager", "sdpa"):
        for got, expected in zip(grads["compiled"], grads[name], strict=True):
            close(got, expected, rtol=1e-4, atol=1e-5)

    key, value = (torch.randn(2, 2, 128, 16, device="cuda", requires_grad=True) for _ in range(2))  # grouped query
    compiled(q, key, value, block_mask=mask, enable_gqa=True).sum().backward()
    flex = [t.grad.cpu() for t in (q, key, value)]
    q.grad = key.grad = value.grad = None
    F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True).sum().backward()
    for got, t in zip(flex, (q, key, value), strict=True):
        assert got.shape == t.shape
        close(got, t.grad.cpu(), rtol=1e-4, atol=1e-5)


@distributed_test(world_size=[2], device="cuda")
def test_flex_attention_gives_a_tensor_its_score_mod_captures_its_gradient(rank):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 16, device="cuda", requires_grad=True) for _ in range(3))
    slopes = torch.rand(4, device="cuda", requires_grad=True)  # a learnt ALiBi slope per head
    mask = create_block_mask(_causal, 1, 1, 128, 128, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def grads_of(out):
        out.pow(2).sum().backward()
        found = [t.grad.cpu() for t in (q, k, v, slopes)]
        q.grad = k.grad = v.grad = slopes.grad = None
        return found

    compiled = grads_of(torch.compile(flex_attention)(q, k, v, score_mod=alibi, block_mask=mask))
    eager = grads_of(flex_attention(q, k, v, score_mod=alibi, block_mask=mask))
    positions = torch.arange(128, device="cuda")
    distance = positions[None, :] - positions[:, None]
    scores = q @ k.transpose(-2, -1) / 4 + slopes[:, None, None] * distance
    scores = scores.masked_fill(distance > 0, float("-inf"))
    written_out = grads_of(scores.softmax(-1) @ v)
    assert compiled[3].abs().sum() > 0  # the slopes are learnt
    for got, flex, expected in zip(compiled, eager, written_out, strict=True):
        close(got, flex, rtol=1e-4, atol=1e-4)
        close(got, expected, rtol=1e-4, atol=1e-4)


@distributed_test(world_size=[2], device="cuda")
def test_compiled_flex_attention_takes_the_memory_its_kernels_allocate(rank):
    # Inductor's flex kernels allocate the output, the logsumexp and the max scores (fp32, (B, H, L)), which
    # backward keeps; its backward the gradients. The scores matrix is never made, so it is not counted.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    B, H, L, D = 2, 4, 256, 32
    q, k, v = (torch.randn(B, H, L, D, device="cuda", requires_grad=True) for _ in range(3))
    mask = create_block_mask(_causal, 1, 1, L, L, device="cuda")
    compiled = torch.compile(flex_attention)
    compiled(q, k, v, block_mask=mask).sum().backward()  # compiled
    q.grad = k.grad = v.grad = None
    tensor, stats = B * H * L * D * 4, B * H * L * 4
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    out = compiled(q, k, v, block_mask=mask)
    assert torch.cuda.memory_allocated() - base == tensor + 2 * stats  # out, logsumexp, max scores
    out.sum().backward()
    del out
    assert torch.cuda.memory_allocated() - base == 3 * tensor  # the gradients; what backward kept is freed
    peak = torch.cuda.max_memory_allocated() - base
    assert tensor + 2 * stats + 3 * tensor <= peak < 4 * tensor + 3 * stats  # no (B, H, L, L) scores
    for t in (q, k, v):
        before = torch.cuda.memory_allocated()
        t.grad = None
        assert before - torch.cuda.memory_allocated() == tensor
    assert torch.cuda.memory_allocated() == base


class _FlexBlock(nn.Module):
    def __init__(self, flex):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out, self.flex = nn.Linear(32, 96), nn.Linear(32, 32), flex

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        if self.flex:
            from torch.nn.attention.flex_attention import flex_attention

            attended = flex_attention(q, k, v, block_mask=mask)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(x.shape))


@distributed_test(world_size=[2], device="cuda")
def test_a_compiled_block_with_flex_attention_trains_as_one_with_sdpa(rank):
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(_causal, None, None, 64, 64, device="cuda")
    torch.manual_seed(1 + rank)
    batches = [torch.randn(2, 64, 32, device="cuda") for _ in range(3)]
    losses = {}
    for flex in (True, False):
        block = _FlexBlock(flex).cuda()
        model = torch.compile(block) if flex else block  # torchtitan compiles each block
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
        losses[flex] = []
        for x in batches:
            loss = model(x, mask).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[flex].append(loss.item())
    close(losses[True], losses[False], rtol=1e-4, atol=1e-6)


# -- flex attention without a block mask, and block masks made by compiled code -----------------------


@distributed_test(world_size=[2], device="cuda")
def test_a_compiled_function_indexes_the_tensors_it_makes_on_the_gpu(rank):
    # Python indexing opens the device guard of the tensor's C++ device: the fake tensors Dynamo makes for
    # `torch.arange(..., device="cuda")` are simulated ones, whose device has a guard
    def masked(x):
        positions = torch.arange(x.shape[-1], device=x.device)
        picked = torch.zeros(x.shape, dtype=torch.bool, device="cuda")
        picked[positions, positions.flip(0)] = True
        return x.masked_fill(positions[:, None] < positions[None, :], 0) + picked

    x = torch.randn(8, 8, device="cuda")
    got = torch.compile(masked, fullgraph=True)(x)
    assert got.device == torch.device("cuda", rank)
    assert torch.equal(got.cpu(), masked(x).cpu())


@distributed_test(world_size=[2], device="cuda")
def test_flex_attention_without_a_block_mask_gives_sdpa_and_the_written_out_attention(rank):
    # Without block_mask, flex attention builds its default mask on the query's device (indexing a tensor that a
    # compiled frame made there), and that mask's mask_mod makes a tensor on the device Dynamo wrote into it.
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 16, device="cuda", requires_grad=True) for _ in range(3))
    slopes = torch.rand(4, device="cuda", requires_grad=True)
    positions = torch.arange(128, device="cuda")
    distance = positions[None, :] - positions[:, None]

    def relative(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) / 64

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def results_of(out):
        assert out.device == torch.device("cuda", rank)
        out.pow(2).sum().backward()
        found = [out.detach().cpu()] + [t.grad.cpu() for t in (q, k, v, slopes) if t.grad is not None]
        q.grad = k.grad = v.grad = slopes.grad = None
        return found

    compiled = torch.compile(flex_attention)
    written_out = {
        None: results_of(F.scaled_dot_product_attention(q, k, v)),  # not causal
        relative: results_of(F.scaled_dot_product_attention(q, k, v, attn_mask=distance / 64)),
        alibi: results_of((q @ k.transpose(-2, -1) / 4 + slopes[:, None, None] * distance).softmax(-1) @ v),
    }
    assert len(written_out[alibi]) == 5 and written_out[alibi][4].abs().sum() > 0  # the slopes are learnt
    for score_mod, expected in written_out.items():
        for attend in (flex_attention, compiled):
            got = results_of(attend(q, k, v) if score_mod is None else attend(q, k, v, score_mod=score_mod))
            assert len(got) == len(expected)
            for found, wanted in zip(got, expected, strict=True):
                # float32 sums in other orders: gradients of outputs squared reach 3e-4 apart, relatively
                close(found, wanted, rtol=1e-3, atol=1e-4)


@distributed_test(world_size=[2], device="cuda")
def test_a_block_mask_made_by_compiled_create_block_mask_is_the_eager_one(rank):
    # torchtitan compiles create_block_mask (document masks of packed sequences), as `_compile=True` does; a mask
    # built from tensors the compiled frame makes only (the causal one) indexes them on the GPU
    import warnings

    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

    positions = torch.cat([torch.arange(n, device="cuda") for n in (48, 80)])  # two documents
    documents = torch.cumsum((positions == 0).int(), dim=0) - 1

    def same_document(b, h, q_idx, kv_idx):
        return documents[q_idx] == documents[kv_idx]

    causal = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, device="cuda") for _ in range(3))
    attend = torch.compile(flex_attention)
    for mask_mod, dense in (
        (_causal, causal),
        (and_masks(_causal, same_document), causal & (documents[:, None] == documents[None, :])),
    ):
        eager = create_block_mask(mask_mod, None, None, 128, 128, device="cuda", BLOCK_SIZE=32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch deprecates _compile=True for torch.compile
            flagged = create_block_mask(mask_mod, None, None, 128, 128, device="cuda", BLOCK_SIZE=32, _compile=True)
        compiled = torch.compile(create_block_mask)(mask_mod, None, None, 128, 128, device="cuda", BLOCK_SIZE=32)
        for made in (flagged, compiled):
            for got, expected in zip(made.as_tuple()[:-1], eager.as_tuple()[:-1], strict=True):
                if isinstance(expected, torch.Tensor):
                    assert got.device == torch.device("cuda", rank)
                    assert torch.equal(got.cpu(), expected.cpu())
                else:
                    assert got == expected
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        close(attend(q, k, v, block_mask=compiled).cpu(), expected.cpu(), rtol=1e-4, atol=1e-5)


@distributed_test(world_size=[2, 4], device="cuda")
def test_torch_export_traces_a_model_on_simulated_gpus_taking_no_memory(rank, world_size):
    """torch.export traces on fake tensors, as Dynamo does: no GPU memory, no cuBLAS workspace, no kernel; the
    exported program then runs on the GPU as the model does."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()
    x = torch.randn(3, 8, device="cuda")
    before = torch.cuda.memory_allocated()
    program = torch.export.export(model, (x,))
    assert torch.cuda.memory_allocated() == before
    torch.testing.assert_close(program.module()(x), model(x))
