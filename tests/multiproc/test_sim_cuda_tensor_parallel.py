"""DeviceMesh, DTensor, tensor and sequence parallelism on simulated GPUs.

Written as PyTorch's distributed tutorials write such programs: the device comes from
`torch.accelerator`, the mesh from `init_device_mesh(acc.type, ...)`, the model is
parallelized with `parallelize_module` plans and sharded with FSDP2's `fully_shard`.
Every parallel run is checked against the same model computing the same batch in one
process (each rank runs that reference on plain CUDA tensors), in fp32.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel.sim.core import torch_internals
from harness import distributed_test

SIZES = [2, 4]
ATOL = 1e-5
RTOL = 1e-5


def _setup(rank):
    acc = torch.accelerator.current_accelerator()
    torch.accelerator.set_device_index(rank)
    return acc, torch.device(acc.type, rank)


def _no_simcuda(*things):
    """Neither the reprs nor what `print` writes of `things` name the hidden device."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print(*things)
    text = " ".join(repr(t) for t in things) + printed.getvalue()
    assert "cuda" in text and "simcuda" not in text.lower(), text


def _close(actual, expected):
    from torch.distributed.tensor import DTensor

    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    assert actual.device.type == expected.device.type == "cuda"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------
# DeviceMesh
# ---------------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_one_dim_mesh_on_the_accelerator(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    acc, device = _setup(rank)
    mesh = init_device_mesh(acc.type, (world_size,), mesh_dim_names=("tp",))
    assert dist.is_initialized() and dist.get_backend() == "nccl"
    assert mesh.device_type == "cuda" and mesh.ndim == 1 and mesh.size() == world_size
    assert mesh.mesh.tolist() == list(range(world_size)) and mesh.get_rank() == rank
    assert mesh.get_local_rank() == rank and list(mesh.get_coordinate()) == [rank]
    assert mesh["tp"].mesh.tolist() == list(range(world_size))
    group = mesh.get_group()
    assert dist.get_backend(group) == "nccl" and dist.get_world_size(group) == world_size
    _no_simcuda(mesh, mesh["tp"])

    t = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(t, group=group)
    assert t.device == device and t.tolist() == [world_size * (world_size + 1) / 2] * 2


@distributed_test(world_size=4, device="cuda")
def test_two_dim_mesh_dp_by_tp(rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _, device = _setup(rank)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.device_type == "cuda" and mesh.shape == (2, 2) and mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    dp, tp = mesh["dp"], mesh["tp"]
    assert dp.device_type == tp.device_type == "cuda"
    assert tp.mesh.tolist() == [2 * (rank // 2), 2 * (rank // 2) + 1]  # my row
    assert dp.mesh.tolist() == [rank % 2, rank % 2 + 2]  # my column
    assert mesh.get_local_rank("dp") == rank // 2 and mesh.get_local_rank("tp") == rank % 2
    assert list(mesh.get_coordinate()) == [rank // 2, rank % 2]
    assert dist.get_backend(mesh.get_group("tp")) == dist.get_backend(mesh.get_group("dp")) == "nccl"
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    assert flat.mesh.tolist() == [0, 1, 2, 3] and flat.device_type == "cuda"
    _no_simcuda(mesh, dp, tp, flat)

    row = torch.tensor([float(rank)], device=device)
    dist.all_reduce(row, group=mesh.get_group("tp"))
    col = torch.tensor([float(rank)], device=device)
    dist.all_reduce(col, group=mesh.get_group("dp"))
    assert row.device == col.device == device
    assert row.item() == sum(tp.mesh.tolist()) and col.item() == sum(dp.mesh.tolist())


# ---------------------------------------------------------------------------------------
# DTensor: distribute_tensor and redistribute
# ---------------------------------------------------------------------------------------


def _grid(rows, cols, device):
    return torch.arange(rows * cols, dtype=torch.float32, device=device).reshape(rows, cols)


@distributed_test(world_size=SIZES, device="cuda")
def test_distribute_tensor_shards_and_replicates(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    acc, device = _setup(rank)
    mesh = init_device_mesh(acc.type, (world_size,))
    full = _grid(2 * world_size, 3 * world_size, device)

    rows = distribute_tensor(full, mesh, [Shard(0)])
    assert isinstance(rows, DTensor) and rows.device == device and rows.is_cuda
    assert rows.shape == full.shape and rows.placements == (Shard(0),)
    local = rows.to_local()
    assert local.device == device and torch.equal(local, full[2 * rank : 2 * rank + 2])
    cols = distribute_tensor(full, mesh, [Shard(1)])
    assert torch.equal(cols.to_local(), full[:, 3 * rank : 3 * rank + 3])
    same = distribute_tensor(full, mesh, [Replicate()])
    assert torch.equal(same.to_local(), full)
    for dt in (rows, cols, same):
        assert dt.device.type == "cuda" and dt.device_mesh.device_type == "cuda"
        assert torch.equal(dt.full_tensor(), full) and dt.full_tensor().device == device
        _no_simcuda(dt, dt.to_local(), dt.device, dt.placements)

    # uneven: 5 rows over the ranks, torch.chunk's split (the last ranks may hold none)
    odd = _grid(5, 2, device)
    sharded = distribute_tensor(odd, mesh, [Shard(0)])
    expected = list(torch.chunk(odd, world_size))
    expected += [odd[:0]] * (world_size - len(expected))
    assert torch.equal(sharded.to_local(), expected[rank])
    assert torch.equal(sharded.full_tensor(), odd)

    # from_local: each rank's own piece, no communication
    mine = torch.full((2, 3), float(rank), device=device)
    built = DTensor.from_local(mine, mesh, [Shard(0)])
    assert built.shape == (2 * world_size, 3) and built.device == device
    assert built.full_tensor()[:, 0].tolist() == [float(r) for r in range(world_size) for _ in range(2)]


@distributed_test(world_size=SIZES, device="cuda")
def test_redistribute_between_shard_replicate_and_partial(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    acc, device = _setup(rank)
    mesh = init_device_mesh(acc.type, (world_size,))
    n = world_size
    full = _grid(2 * n, 2 * n, device)

    def check(dt, placement, local):
        assert dt.placements == (placement,) and dt.device == device
        assert dt.to_local().device == device
        assert torch.equal(dt.to_local(), local), (placement, dt.to_local(), local)

    row_part, col_part = full.chunk(n, 0)[rank], full.chunk(n, 1)[rank]
    # Shard <-> Replicate, Shard(0) <-> Shard(1)
    for src in (Shard(0), Shard(1), Replicate()):
        dt = distribute_tensor(full, mesh, [src])
        check(dt.redistribute(mesh, [Replicate()]), Replicate(), full)
        check(dt.redistribute(mesh, [Shard(0)]), Shard(0), row_part)
        check(dt.redistribute(mesh, [Shard(1)]), Shard(1), col_part)

    # Partial(sum): rank r holds (r + 1) * full, the sum is n(n+1)/2 * full
    total = n * (n + 1) // 2
    partial = DTensor.from_local(full * (rank + 1), mesh, [Partial()])
    assert partial.placements == (Partial("sum"),)
    check(partial.redistribute(mesh, [Replicate()]), Replicate(), full * total)
    check(partial.redistribute(mesh, [Shard(0)]), Shard(0), row_part * total)  # reduce-scatter
    check(partial.redistribute(mesh, [Shard(1)]), Shard(1), col_part * total)
    assert torch.equal(partial.full_tensor(), full * total)

    # Partial(avg / max / min)
    for op, value in (("avg", (n + 1) / 2), ("max", n), ("min", 1)):
        p = DTensor.from_local(full * (rank + 1), mesh, [Partial(op)])
        check(p.redistribute(mesh, [Replicate()]), Replicate(), full * value)
        check(p.redistribute(mesh, [Shard(0)]), Shard(0), row_part * value)

    # to Partial: DTensor keeps that for itself (as on GPUs), whatever the source; from torch 2.14 on
    # it redistributes Shard to Partial(sum), and refuses Replicate in other words (torch_internals.TORCH_CHANGES)
    refused_sources = (Replicate(),) if torch_internals.at_least("2.14") else (Replicate(), Shard(0))
    words = "only Shard to Partial" if torch_internals.at_least("2.14") else "redistributing to Partial is for internal"
    for src in refused_sources:
        with pytest.raises(RuntimeError, match=words) as refused:
            distribute_tensor(full, mesh, [src]).redistribute(mesh, [Partial()])
        assert "simcuda" not in str(refused.value)
    if torch_internals.at_least("2.14"):
        pending = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Partial()])
        assert pending.placements == (Partial(),) and pending.device == device
        assert pending.to_local().device == device and pending.to_local().shape == full.shape
        assert torch.equal(pending.full_tensor(), full)

    # uneven shards redistribute too
    odd = _grid(5, 3, device)
    dt = distribute_tensor(odd, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    expected = list(torch.chunk(odd, n, dim=1))
    expected += [odd[:, :0]] * (n - len(expected))
    assert torch.equal(dt.to_local(), expected[rank]) and torch.equal(dt.full_tensor(), odd)

    # ops on DTensors: a column-sharded times a row-sharded matrix is a pending sum
    a, b = _grid(3, 2 * n, device), _grid(2 * n, 4, device) - 5
    da, db = distribute_tensor(a, mesh, [Shard(1)]), distribute_tensor(b, mesh, [Shard(0)])
    prod = da @ db
    assert prod.placements == (Partial(),) and prod.device == device
    assert torch.equal(prod.full_tensor(), a @ b)
    _no_simcuda(prod, partial)


@distributed_test(world_size=4, device="cuda")
def test_redistribute_on_a_two_dim_mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    acc, device = _setup(rank)
    mesh = init_device_mesh(acc.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = rank // 2, rank % 2
    full = _grid(4, 8, device)

    both = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert torch.equal(both.to_local(), full[2 * dp_rank : 2 * dp_rank + 2, 4 * tp_rank : 4 * tp_rank + 4])
    nested = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    assert torch.equal(nested.to_local(), full[rank : rank + 1])
    for dt in (both, nested):
        assert torch.equal(dt.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full)
        assert torch.equal(dt.full_tensor(), full) and dt.device == device
    swapped = both.redistribute(mesh, [Shard(1), Shard(0)])
    assert torch.equal(swapped.to_local(), full[2 * tp_rank : 2 * tp_rank + 2, 4 * dp_rank : 4 * dp_rank + 4])
    tp_only = both.redistribute(mesh, [Replicate(), Shard(1)])
    assert torch.equal(tp_only.to_local(), full[:, 4 * tp_rank : 4 * tp_rank + 4])

    # partial over tp, sharded over dp: rank holds (tp_rank + 1) * its dp rows
    pending = DTensor.from_local(full[2 * dp_rank : 2 * dp_rank + 2] * (tp_rank + 1), mesh, [Shard(0), Partial()])
    assert torch.equal(pending.full_tensor(), full * 3)
    rows = pending.redistribute(mesh, [Shard(0), Shard(1)])
    assert torch.equal(rows.to_local(), 3 * full[2 * dp_rank : 2 * dp_rank + 2, 4 * tp_rank : 4 * tp_rank + 4])
    _no_simcuda(mesh, both, pending, rows.device_mesh)
    assert both.device_mesh.device_type == "cuda"


# ---------------------------------------------------------------------------------------
# Tensor and sequence parallelism: a small Llama-like transformer, as in torch's TP tutorial
# ---------------------------------------------------------------------------------------

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 16, 16, 4, 32, 1
BATCH, SEQ = 2, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads = HEADS
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        # n_heads is divided by the tp degree after parallelizing, as the tutorial does
        heads = (bsz, seqlen, self.n_heads, self.head_dim)
        q, k, v = (w(x).view(heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _models(device):
    """The reference and the copy to parallelize: same weights (seeded), both on the GPU."""
    torch.manual_seed(0)
    reference = Transformer().to(device)
    return reference, copy.deepcopy(reference)


def _batch(device, seed=1, batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _tp_plan(loss_parallel=False):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block


def _parallelize(model, tp_mesh, loss_parallel=False, dp_mesh=None):
    from torch.distributed.tensor.parallel import parallelize_module

    top, block_plan = _tp_plan(loss_parallel)
    model = parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        block.attention.n_heads //= tp_mesh.size()
        parallelize_module(block, tp_mesh, block_plan)
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _optimizer(model):
    # SGD with momentum: Adam would magnify float rounding in tiny gradients past a tight tolerance
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=True)


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _check_weights(parallel, reference):
    names = dict(reference.named_parameters())
    seen = 0
    for name, param in parallel.named_parameters():
        assert param.device.type == "cuda"
        _close(param.detach(), names[name].detach())  # fully_shard keeps the names
        seen += 1
    assert seen == len(names)


@distributed_test(world_size=SIZES, device="cuda")
def test_tensor_and_sequence_parallel_training_equals_one_process(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    acc, device = _setup(rank)
    tp_mesh = init_device_mesh(acc.type, (world_size,), mesh_dim_names=("tp",))
    reference, model = _models(device)
    model = _parallelize(model, tp_mesh)

    w1 = model.layers[0].feed_forward.w1.weight
    wo = model.layers[0].attention.wo.weight
    emb = model.tok_embeddings.weight
    assert isinstance(w1, DTensor) and w1.placements == (Shard(0),) and w1.device == device
    assert wo.placements == (Shard(1),) and emb.placements == (Shard(0),)
    assert model.norm.weight.placements == (Replicate(),)
    assert w1.to_local().shape == (HIDDEN // world_size, DIM)
    assert all(p.device.type == "cuda" and p.device_mesh.device_type == "cuda" for p in model.parameters())
    _no_simcuda(w1, model.layers[0], model.norm.weight)

    ref_opt = _optimizer(reference)
    opt = _optimizer(model)
    for step in range(3):
        tokens, labels = _batch(device, seed=step)  # the same batch on every tp rank
        logits = model(tokens)
        assert not isinstance(logits, DTensor) and logits.device == device
        ref_logits = reference(tokens)
        _close(logits, ref_logits)
        loss, ref_loss = _loss(logits, labels), _loss(ref_logits, labels)
        _close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        g = model.layers[0].feed_forward.w2.weight.grad
        assert isinstance(g, DTensor) and g.placements == (Shard(1),) and g.device == device
        _close(g, reference.layers[0].feed_forward.w2.weight.grad)
        _close(model.norm.weight.grad, reference.norm.weight.grad)  # sequence-parallel grads summed
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _check_weights(model, reference)
    momentum = opt.state[w1]["momentum_buffer"]
    assert isinstance(momentum, DTensor) and momentum.placements == (Shard(0),) and momentum.device == device


@distributed_test(world_size=SIZES, device="cuda")
def test_loss_parallel_on_a_vocab_sharded_output(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    acc, device = _setup(rank)
    tp_mesh = init_device_mesh(acc.type, (world_size,), mesh_dim_names=("tp",))
    reference, model = _models(device)
    model = _parallelize(model, tp_mesh, loss_parallel=True)
    ref_opt = _optimizer(reference)
    opt = _optimizer(model)
    for step in range(2):
        tokens, labels = _batch(device, seed=10 + step)
        logits = model(tokens)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),) and logits.device == device
        assert logits.to_local().shape == (BATCH, SEQ, VOCAB // world_size)
        ref_logits = reference(tokens)
        _close(logits, ref_logits)
        with loss_parallel():
            loss = _loss(logits, labels)
            assert isinstance(loss, DTensor) and loss.device == device
            loss.backward()
        ref_loss = _loss(ref_logits, labels)
        ref_loss.backward()
        _close(loss, ref_loss)
        _close(model.output.weight.grad, reference.output.weight.grad)
        _close(model.tok_embeddings.weight.grad, reference.tok_embeddings.weight.grad)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _check_weights(model, reference)
    _no_simcuda(logits, loss)


@distributed_test(world_size=4, device="cuda")
def test_fsdp2_on_dp_by_tensor_parallel_on_tp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    acc, device = _setup(rank)
    mesh = init_device_mesh(acc.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    reference, model = _models(device)
    model = _parallelize(model, mesh["tp"], dp_mesh=mesh["dp"])

    w1 = model.layers[0].feed_forward.w1.weight
    assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names == ("dp", "tp")
    # FSDP shards the tp shard's rows over dp (a strided shard of the full rows)
    assert w1.placements[1] == Shard(0) and w1.placements[0].dim == 0 and w1.device == device
    assert w1.to_local().shape == (HIDDEN // 4, DIM)
    _no_simcuda(w1, model)

    ref_opt = _optimizer(reference)
    opt = _optimizer(model)
    for step in range(3):
        tokens, labels = _batch(device, seed=20 + step, batch=2 * BATCH)  # the global batch
        mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)  # this dp rank's half
        logits = model(tokens[mine])
        loss = _loss(logits, labels[mine])
        ref_logits = reference(tokens)
        _close(logits, ref_logits[mine])
        _close(loss, _loss(ref_logits[mine], labels[mine]))
        loss.backward()  # FSDP averages the gradients over dp: the mean over the global batch
        _loss(ref_logits, labels).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _check_weights(model, reference)


@distributed_test(world_size=SIZES, device="cuda")
def test_async_redistribute_and_functional_collectives_give_collective_tensors_to_wait_on(rank, world_size):
    # As on a GPU: a functional collective's result is an AsyncCollectiveTensor (waited on at first use), so
    # `redistribute(async_op=True)` leaves one as the DTensor's local tensor; its values are the collective's.
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    _, device = _setup(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    whole = torch.arange(4.0 * world_size, device=device)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    gathered = sharded.redistribute(mesh, [Replicate()], async_op=True)
    assert isinstance(gathered._local_tensor, funcol.AsyncCollectiveTensor)
    assert torch.equal(gathered.to_local().cpu(), whole.cpu())
    assert gathered.to_local().device == device
    reduced = funcol.all_reduce(torch.full((3,), float(rank + 1), device=device), "sum", mesh)
    assert isinstance(reduced, funcol.AsyncCollectiveTensor)
    waited = funcol.wait_tensor(reduced)
    assert waited.device == device and waited.tolist() == [world_size * (world_size + 1) / 2] * 3
    synced = sharded.redistribute(mesh, [Replicate()])  # the default: waited on before it returns
    assert not isinstance(synced._local_tensor, funcol.AsyncCollectiveTensor)


@distributed_test(world_size=SIZES, device="cuda")
def test_complex_partial_reduce_scatters_as_pairs_of_reals(rank, world_size):
    """NCCL has no complex type: c10d reduces complex numbers as pairs of reals, for the ops that allow it."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import Partial

    mesh = init_device_mesh("cuda", (world_size,))
    local = torch.full((2 * world_size, 3), complex(rank, 1), dtype=torch.complex64, device="cuda")
    partial = DTensor.from_local(local, mesh, [Partial()])
    sharded = partial.redistribute(mesh, [Shard(0)]).to_local()
    expected = complex(sum(range(world_size)), world_size)
    assert sharded.dtype == torch.complex64 and sharded.shape == (2, 3)
    assert torch.equal(sharded.cpu(), torch.full((2, 3), expected, dtype=torch.complex64))
    with pytest.raises(ValueError, match="does not support .*MAX.* on complex tensors"):
        funcol.reduce_scatter_tensor(local, "max", 0, mesh)
