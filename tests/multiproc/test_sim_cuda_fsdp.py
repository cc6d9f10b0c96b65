"""FSDP2 (`fully_shard`) and FSDP1 on simulated GPUs, written as PyTorch's FSDP2 tutorial and torchtitan write them.

A small transformer-like model (token embedding, blocks of LayerNorm + MLP with a
residual, final norm, output head) is sharded per block and at the root on a "cuda"
device mesh carried by the simulated NCCL group. Its vocabulary (50) does not divide by
4, so on 4 ranks some shards are padded. fp32 FSDP2 and FSDP1 training give the losses
DDP gives on the same simulated GPUs with the same data (to rounding: the gradient
reductions add in another order). Parameters, gradients, optimizer states and meshes
say "cuda", and nothing names the hidden device ("simcuda").
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import distributed_test

SIZES = [2, 4]
VOCAB, DIM, LAYERS, BATCH, SEQ = 50, 16, 3, 4, 8
STEPS = 3


class Block(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def reset_parameters(self):
        for module in (self.norm, self.up, self.down):
            module.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h).flatten(0, 1))  # (batch * seq, vocab) logits

    def reset_parameters(self):  # torchtitan's init_weights
        self.tok_embeddings.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        self.output.reset_parameters()


def make_batches(rank: int, steps: int = STEPS, batch: int = BATCH):
    """This rank's own token batches (inputs, next-token targets), on its GPU."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=generator).cuda()
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_of(model, inputs, targets):
    return F.cross_entropy(model(inputs), targets.flatten())


def build(seed: int = 0) -> Transformer:
    """The model, initialised on this rank's GPU from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    return Transformer().cuda()


def shard(model, **kwargs):
    """torchtitan's way: one FSDP unit per block, then the root (embedding, final norm, output)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(model, data, clip: float | None = None, norms: list | None = None):
    """AdamW steps over `data`; the loss of each step on this rank (and each total grad norm in `norms`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in data:
        loss = loss_of(model, inputs, targets)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def ddp_run(rank, data, clip: float | None = None, norms: list | None = None):
    """The reference: the same model and data under DDP on the same simulated GPUs; (losses, module)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(build(), device_ids=[rank])
    return train(ddp, data, clip, norms)[0], ddp.module


def full_state(model) -> dict:
    """Every parameter as one full CPU tensor (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for name, p in model.named_parameters()
    }


def assert_on_gpu(tensor, rank):
    """A tensor (a DTensor or a local one) on this rank's GPU, and nothing names the hidden device."""
    from torch.distributed.tensor import DTensor

    here = torch.device("cuda", rank)
    assert tensor.device == here and tensor.is_cuda, tensor.device
    text = str(tensor.device) + repr(tensor)
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        assert tensor.device_mesh.device_type == "cuda" and local.device == here and local.is_cuda
        text += str(tensor.device_mesh) + repr(local)
    assert "simcuda" not in text, text


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), rtol=rtol, atol=atol)


def close_to_module(weights: dict, module, rtol=1e-4, atol=1e-5):
    reference = {name: p.detach().cpu() for name, p in module.named_parameters()}
    assert weights.keys() == reference.keys()
    for name, weight in weights.items():
        close(weight, reference[name], rtol=rtol, atol=atol)


# -- FSDP2 ------------------------------------------------------------------------------


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@distributed_test(world_size=SIZES, device="cuda")
def test_fsdp2_trains_as_ddp_does(rank, world_size, reshard_after_forward):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, reference = ddp_run(rank, data)

    model = shard(build(), reshard_after_forward=reshard_after_forward)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.layers)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == world_size
        assert_on_gpu(p, rank)
    shard_rows = torch.arange(VOCAB).chunk(world_size)[rank].numel()  # torch.chunk's split: 13, 13, 13, 11 on 4
    assert model.output.weight.to_local().shape == (shard_rows, DIM)

    # after its forward, a block keeps its full parameters unless it reshards
    loss = loss_of(model, *data[0])
    for layer in model.layers:
        assert isinstance(layer.up.weight, DTensor) == reshard_after_forward
        if not reshard_after_forward:
            assert layer.up.weight.shape == (4 * DIM, DIM) and layer.up.weight.device == torch.device("cuda", rank)
    loss.backward()
    for p in model.parameters():  # resharded after backward, with sharded gradients
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),)
        assert_on_gpu(p.grad, rank)
    model.zero_grad()

    losses, optimizer = train(model, data)
    close(losses, expected)
    close_to_module(full_state(model), reference)
    for state in optimizer.state.values():  # AdamW's moments are sharded like their parameters, on the GPU
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor) and state[key].placements == (Shard(0),)
            assert_on_gpu(state[key], rank)


@distributed_test(world_size=SIZES, device="cuda")
def test_meta_init_then_to_empty_and_reset_parameters(rank, world_size):
    """torchtitan: build on the meta device, shard, `to_empty` on the GPU, then initialise the shards.

    As on GPUs (DTensor's own tests check this), every shard draws its own numbers, the
    ranks agree on the whole tensor and their generators are left in step. A sharded
    draw does not reproduce an unsharded one on GPUs either (each shard starts at its own
    Philox offset), so the weights are checked for what an init guarantees.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(rank)
    with torch.device("meta"):
        model = Transformer()
    shard(model)
    assert all(p.is_meta and isinstance(p, DTensor) for p in model.parameters())
    model.to_empty(device="cuda")
    for p in model.parameters():
        assert isinstance(p, DTensor) and not p.is_meta
        assert_on_gpu(p, rank)
    torch.manual_seed(0)
    with torch.no_grad():
        model.reset_parameters()

    weights = full_state(model)
    assert all(torch.isfinite(weight).all() for weight in weights.values())
    for i in range(LAYERS):
        assert torch.equal(weights[f"layers.{i}.norm.weight"], torch.ones(DIM))
        assert torch.equal(weights[f"layers.{i}.norm.bias"], torch.zeros(DIM))
        up = weights[f"layers.{i}.up.weight"]
        bound = 1 / DIM**0.5  # a Linear's kaiming_uniform_(a=sqrt(5))
        assert up.abs().max() <= bound and up.std() > bound / 4
        shards = up.chunk(world_size)  # each rank drew its own shard: no shard repeats another
        assert not any(torch.equal(shards[0], other) for other in shards[1:])
    embedding = weights["tok_embeddings.weight"]  # normal_(0, 1)
    assert abs(embedding.mean()) < 0.2 and 0.8 < embedding.std() < 1.2
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (weights, torch.cuda.get_rng_state()))
    for others, state in everyone:
        assert all(torch.equal(others[name], weights[name]) for name in weights)
        assert torch.equal(state, everyone[0][1])  # the generators are still in step

    loss = loss_of(model, *make_batches(rank, steps=1)[0])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


@distributed_test(world_size=SIZES, device="cuda")
def test_meta_init_then_the_reference_weights_loaded(rank):
    """The two loading paths of the FSDP2 example: DCP's `set_model_state_dict` from rank 0's full state dict,
    and `distribute_tensor` of each full tensor into `load_state_dict(assign=True)`; both train as DDP does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, _ = ddp_run(rank, data)
    reference = build().state_dict()

    with torch.device("meta"):
        broadcast = Transformer()
    shard(broadcast)
    broadcast.to_empty(device="cuda")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(broadcast, dict(reference) if rank == 0 else {}, options=options)  # it empties the dict

    with torch.device("meta"):
        assigned = Transformer()
    shard(assigned)
    meta_sharded = assigned.state_dict()
    sharded = {}
    for name, full_tensor in reference.items():
        meta = meta_sharded[name]
        sharded[name] = nn.Parameter(distribute_tensor(full_tensor, meta.device_mesh, meta.placements))
    assigned.load_state_dict(sharded, assign=True)

    for model in (broadcast, assigned):
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and not p.is_meta
            assert_on_gpu(p, rank)
            assert torch.equal(p.full_tensor(), reference[name]), name
        close(train(model, data)[0], expected)


@distributed_test(world_size=SIZES, device="cuda")
def test_mixed_precision_bf16_params_fp32_reduction(rank):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    fp32, _ = train(shard(build()), data)

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(build(), mp_policy=policy)
    seen = []

    def record(module, args, out):
        seen.append((module.weight.dtype, args[0].dtype, out.dtype))

    model.layers[0].up.register_forward_hook(record)
    losses, _ = train(model, data)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16)] * STEPS  # the forward ran in bf16
    assert losses != fp32
    close(losses, fp32, rtol=2e-2, atol=2e-2)
    loss_of(model, *data[0]).backward()
    for p in model.parameters():  # sharded parameters and their reduced gradients stay fp32
        assert isinstance(p, DTensor) and p.dtype == p.grad.dtype == torch.float32
        assert_on_gpu(p.grad, rank)


@distributed_test(world_size=SIZES, device="cuda")
def test_explicit_forward_and_backward_prefetch(rank):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, _ = ddp_run(rank, data)

    model = shard(build())
    layers = list(model.layers)
    for i, layer in enumerate(layers[:-1]):
        layer.set_modules_to_forward_prefetch([layers[i + 1]])
    for i, layer in enumerate(layers[1:], start=1):
        layer.set_modules_to_backward_prefetch([layers[i - 1]])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_of(model, *data[0]).backward()
    model.zero_grad()
    names = {event.name for event in prof.events()}
    assert {f"FSDP::forward_prefetch for layers.{i}" for i in range(1, LAYERS)} <= names
    assert {f"FSDP::backward_prefetch for layers.{i}" for i in range(LAYERS - 1)} <= names
    close(train(model, data)[0], expected)


@distributed_test(world_size=SIZES, device="cuda")
def test_unshard_and_reshard(rank):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(rank)
    model = shard(build())
    inputs, targets = make_batches(rank, steps=1)[0]
    full = full_state(model)
    with torch.no_grad():
        sharded_loss = loss_of(model, inputs, targets)

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:  # unshard() is not recursive: each unit all-gathers its own parameters
        unit.unshard()
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor) and p.device == torch.device("cuda", rank), name
        assert torch.equal(p.detach().cpu(), full[name])
    with torch.no_grad():
        assert torch.equal(loss_of(model, inputs, targets), sharded_loss)
    for unit in units:
        unit.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())

    handle = model.layers[1].unshard(async_op=True)
    handle.wait()
    assert not isinstance(model.layers[1].up.weight, DTensor) and isinstance(model.layers[0].up.weight, DTensor)
    assert torch.equal(model.layers[1].up.weight.detach().cpu(), full["layers.1.up.weight"])
    model.layers[1].reshard()
    assert isinstance(model.layers[1].up.weight, DTensor)


@distributed_test(world_size=SIZES, device="cuda")
def test_gradient_accumulation_without_sync(rank, world_size):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    micro = make_batches(rank, steps=2, batch=2)
    model = shard(build())

    model.set_requires_gradient_sync(False)
    (loss_of(model, *micro[0]) / 2).backward()
    assert all(p.grad is None for p in model.parameters())  # nothing reduced yet
    model.set_requires_gradient_sync(True)
    (loss_of(model, *micro[1]) / 2).backward()
    grads = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}

    # the gradient of the mean loss over every rank's whole batch, on one GPU
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [(x.cpu(), y.cpu()) for x, y in micro])
    inputs = torch.cat([x for batches in everyone for x, _ in batches]).cuda()
    targets = torch.cat([y for batches in everyone for _, y in batches]).cuda()
    whole = build()
    loss_of(whole, inputs, targets).backward()
    for name, p in whole.named_parameters():
        close(grads[name], p.grad.cpu(), rtol=1e-5, atol=1e-7)


@distributed_test(world_size=SIZES, device="cuda")
def test_clip_grad_norm_over_dtensor_gradients(rank):
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected_norms = []
    expected, reference = ddp_run(rank, data, clip=0.1, norms=expected_norms)
    norms = []
    model = shard(build())
    losses, _ = train(model, data, clip=0.1, norms=norms)

    for total in norms:  # the total norm over DTensor gradients is a DTensor, on the GPU
        assert isinstance(total, DTensor)
        assert_on_gpu(total, rank)
    assert all(n.device == torch.device("cuda", rank) for n in expected_norms)
    close([n.full_tensor().item() for n in norms], [n.item() for n in expected_norms])
    assert min(expected_norms) > 0.1  # every step was clipped
    close(losses, expected)
    close_to_module(full_state(model), reference)


@distributed_test(world_size=4, device="cuda")
def test_fsdp2_hybrid_sharding_on_a_2d_mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, _ = ddp_run(rank, data)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard(build(), mesh=mesh)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0))
        assert_on_gpu(p, rank)
    close(train(model, data)[0], expected)


# -- FSDP1 ------------------------------------------------------------------------------


def fsdp1(model, strategy, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.cuda.current_device(),  # as the FSDP tutorial passes it
        **kwargs,
    )


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@distributed_test(world_size=SIZES, device="cuda")
def test_fsdp1_trains_as_ddp_does(rank, strategy):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, reference = ddp_run(rank, data)
    model = fsdp1(build(), strategy)
    assert model.compute_device == torch.device("cuda", rank)
    assert sum(isinstance(m, FSDP) for m in model.modules()) == LAYERS + 1
    for p in model.parameters():
        assert_on_gpu(p, rank)
    close(train(model, data)[0], expected)
    with FSDP.summon_full_params(model):
        weights = {name.replace("_fsdp_wrapped_module.", ""): p.detach().cpu() for name, p in model.named_parameters()}
    close_to_module(weights, reference)


@distributed_test(world_size=4, device="cuda")
def test_fsdp1_hybrid_shard_on_a_2d_mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank)
    data = make_batches(rank)
    expected, _ = ddp_run(rank, data)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fsdp1(build(), "HYBRID_SHARD", device_mesh=mesh)
    assert model.compute_device == torch.device("cuda", rank)
    for p in model.parameters():
        assert_on_gpu(p, rank)
    close(train(model, data)[0], expected)


@distributed_test(world_size=SIZES, device="cuda")
def test_fsdp1_materialises_a_meta_model_on_the_gpu(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.cuda.set_device(rank)
    with torch.device("meta"):
        model = Transformer()
    torch.manual_seed(0)
    model = fsdp1(model, "FULL_SHARD")  # each module's reset_parameters() runs on the GPU
    assert model.compute_device == torch.device("cuda", rank)
    for p in model.parameters():
        assert not p.is_meta
        assert_on_gpu(p, rank)
    losses, _ = train(model, make_batches(rank))
    assert all(torch.isfinite(torch.tensor(losses)))
    with FSDP.summon_full_params(model):
        weights = [p.detach().cpu() for p in model.parameters()]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, weights)  # the ranks hold one model
    assert all(torch.equal(a, b) for others in everyone for a, b in zip(others, weights, strict=True))


@distributed_test(world_size=[2], device="cuda")
def test_fsdp1_root_without_parameters_of_its_own_computes_on_the_current_gpu(rank):
    """An auto-wrapped root (Lightning's FSDP with a wrap policy) keeps no parameter: the current GPU it is."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = FSDP(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), device_id=rank, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    assert model.compute_device == torch.device("cuda", rank)
    out = model(torch.ones(2, 4, device="cuda"))
    assert out.device == torch.device("cuda", rank) and out.shape == (2, 2)
    with pytest.raises(ValueError, match=f"Inconsistent compute device and `device_id` on rank {rank}"):
        FSDP(nn.Sequential(nn.Linear(4, 8)), device_id=1 - rank, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


@pytest.mark.parametrize("rows", [3, 5])
@distributed_test(world_size=SIZES, device="cuda")
def test_a_state_dict_taken_before_training_shares_the_uneven_shards(rank, world_size, rows):
    """FSDP2 pads an uneven shard once, at `fully_shard`: a `state_dict()` taken then stays the parameters'
    own memory through the first forward and the optimizer's steps (a trainer may keep it and not ask again)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Linear(rows, rows, bias=False)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = model.state_dict()

    def shared():
        return state["weight"]._local_tensor.untyped_storage().data_ptr() == (
            model.weight._local_tensor.untyped_storage().data_ptr()
        )

    assert shared()
    inp = torch.rand(4, rows, device="cuda")
    for _ in range(3):
        optim.zero_grad()
        model(inp).sum().backward()
        optim.step()
        assert shared()
    assert torch.equal(state["weight"].full_tensor(), model.weight.full_tensor())
