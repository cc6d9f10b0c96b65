"""FSDP2 through `Accelerator` on 2 and 4 simulated GPUs: wrapping policies, accumulation, clipping,
mixed precision, state dicts, sharded and full checkpoints, resume, and what is refused."""

import os

import pytest
import torch
from torch import nn

from harness import distributed_test

SIZES = [2, 4]


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x):
        return x + self.outer(torch.tanh(self.inner(x)))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, width=8, depth=3):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def data(world_size, steps, per_rank=4, width=8):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(steps, world_size * per_rank, width, generator=generator)
    return x, x.sum(dim=-1, keepdim=True).sin()


def plugin(**fields):
    from accel.utils import FullyShardedDataParallelPlugin

    fields.setdefault("auto_wrap_policy", "transformer_based_wrap")
    return FullyShardedDataParallelPlugin(fsdp_version=2, **fields)


def reference(steps, world_size, accumulation=1, clip=None, lr=0.05):
    """The same training on one process, full global batches (fp32): what FSDP2 must reproduce."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = data(world_size, steps)
    for step in range(steps):
        loss = nn.functional.mse_loss(model(x[step]), y[step]) / accumulation
        loss.backward()
        if (step + 1) % accumulation == 0:
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def train(accelerator, model, optimizer, rank, world_size, steps, start=0, clip=None, per_rank=4):
    x, y = data(world_size, start + steps)
    losses = []
    for step in range(start, start + steps):
        inputs = x[step, rank * per_rank : (rank + 1) * per_rank].to(accelerator.device)
        targets = y[step, rank * per_rank : (rank + 1) * per_rank].to(accelerator.device)
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def build(fsdp_plugin, lr=0.05, momentum=0.0, **accelerator_kwargs):
    from accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=fsdp_plugin, **accelerator_kwargs)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def assert_close_to(state, expected):
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert torch.allclose(state[name].cpu(), value, atol=1e-5, rtol=1e-5), name


@distributed_test(world_size=SIZES, device="cuda")
@pytest.mark.parametrize("accumulation,clip", [(1, None), (2, 0.05)])
def test_fsdp2_training_equals_one_process(rank, world_size, accumulation, clip):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from accel.utils import DistributedType

    accelerator, model, optimizer = build(plugin(), gradient_accumulation_steps=accumulation)
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.state.is_fsdp2
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
    assert not isinstance(model.head, FSDPModule)  # only the named classes and the root
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert all(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
    assert accelerator.unwrap_model(model) is model
    train(accelerator, model, optimizer, rank, world_size, steps=4, clip=clip)
    state = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(state, reference(4, world_size, accumulation, clip))
    else:
        assert state == {}


@distributed_test(world_size=2, device="cuda")
def test_accumulation_skips_the_reduce_scatter(rank):
    accelerator, model, optimizer = build(plugin(), gradient_accumulation_steps=2)
    x = torch.full((2, 8), float(rank + 1), device=accelerator.device)
    with accelerator.accumulate(model):
        accelerator.backward(model(x).sum())
        assert not accelerator.sync_gradients
        # no reduce-scatter: the gradient stays unsharded inside FSDP, the sharded parameter has none yet
        assert model.head.weight.grad is None
    with accelerator.accumulate(model):
        accelerator.backward(model(x).sum())
        assert accelerator.sync_gradients
        grad = model.head.weight.grad
        assert grad is not None and grad.placements == model.head.weight.placements


@distributed_test(world_size=SIZES, device="cuda")
def test_size_based_wrapping(rank):
    from torch.distributed.fsdp import FSDPModule

    _, model, _ = build(plugin(auto_wrap_policy="size_based_wrap", min_num_params=100))
    wrapped = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule) and name)
    # Blocks hold 144 parameters (the Sequential of them 432), their linears 72, the head 9
    assert wrapped == ["blocks", "blocks.0", "blocks.1", "blocks.2"]


@distributed_test(world_size=2, device="cuda")
def test_reshard_after_forward_and_activation_checkpointing(rank):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    accelerator, model, optimizer = build(plugin(reshard_after_forward=False, activation_checkpointing=True))
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    train(accelerator, model, optimizer, rank, 2, steps=3)
    state = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(state, reference(3, 2))  # the same numbers, recomputed activations or not


@distributed_test(world_size=2, device="cuda")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_policy(rank, precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    accelerator, model, optimizer = build(plugin(), mixed_precision=precision)
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    assert isinstance(policy, MixedPrecisionPolicy) and policy.param_dtype == dtype == policy.reduce_dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    x = torch.randn(4, 8, device=accelerator.device)
    assert model(x).dtype == dtype
    losses = train(accelerator, model, optimizer, rank, 2, steps=6)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@distributed_test(world_size=SIZES, device="cuda")
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_state_and_resume(rank, world_size, tmp_path, kind):
    from accel.state import reset_state

    # momentum: the optimizer has per-parameter state to save and restore
    accelerator, model, optimizer = build(plugin(state_dict_type=kind), momentum=0.9)
    train(accelerator, model, optimizer, rank, world_size, steps=2)
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    names = set(os.listdir(folder))
    if kind == "SHARDED_STATE_DICT":
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= names
        assert any(n.endswith(".distcp") for n in os.listdir(os.path.join(folder, "pytorch_model_fsdp_0")))
    else:
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= names
    assert f"random_states_{rank}.pkl" in names
    train(accelerator, model, optimizer, rank, world_size, steps=2, start=2)
    expected = accelerator.get_state_dict(model)

    reset_state()
    accelerator, model, optimizer = build(plugin(state_dict_type=kind), momentum=0.9)
    torch.manual_seed(123)  # different weights before loading
    accelerator.load_state(folder)
    train(accelerator, model, optimizer, rank, world_size, steps=2, start=2)
    resumed = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(resumed, expected)


@distributed_test(world_size=2, device="cuda")
def test_save_model_writes_the_full_weights(rank, tmp_path):
    from accel.utils import load_checkpoint_in_model

    accelerator, model, optimizer = build(plugin())
    train(accelerator, model, optimizer, rank, 2, steps=2)
    accelerator.save_model(model, str(tmp_path / "out"), max_shard_size="1KB")
    accelerator.wait_for_everyone()
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
    plain = Net()
    load_checkpoint_in_model(plain, str(tmp_path / "out"), device_map={"": "cpu"})
    state = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(plain.state_dict(), state)


@distributed_test(world_size=2, device="cuda")
def test_cpu_ram_efficient_loading_takes_rank0_weights(rank):
    from accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=plugin(cpu_ram_efficient_loading=True))
    torch.manual_seed(rank)  # the ranks start from different weights; rank 0's must win
    model = Net()
    mine = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(state, mine)
    x = torch.randn(2, 8, device=accelerator.device)
    accelerator.backward(model(x).sum())
    optimizer.step()


@distributed_test(world_size=2, device="cuda")
def test_what_fsdp2_refuses(rank):
    from accel import Accelerator
    from accel.state import reset_state
    from accel.utils import FullyShardedDataParallelPlugin

    with pytest.raises(NotImplementedError, match="fsdp_version=2"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    reset_state()
    # a model prepared without its optimizer is sharded (test_fsdp_helpers_ranks.py); Accelerate refuses it
    from accel.fsdp import auto_wrap_predicate

    with pytest.raises(ValueError, match="Could not find the transformer layer class Nope"):
        auto_wrap_predicate(plugin(transformer_cls_names_to_wrap=["Nope"]), Net())


@distributed_test(world_size=2, device="cpu")
def test_on_cpu_ranks_the_plugin_is_kept_and_ddp_runs(rank):
    # as Accelerate: FSDP is a GPU distributed type; CPU ranks train with DDP
    from accel import Accelerator
    from accel.utils import DistributedType

    accelerator = Accelerator(fsdp_plugin=plugin())
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    assert accelerator.state.fsdp_plugin is not None and not accelerator.state.is_fsdp2


@distributed_test(world_size=2, device="cuda")
def test_ignored_modules_stay_whole(rank):
    from torch.distributed.tensor import DTensor

    accelerator, model, optimizer = build(plugin(ignored_modules=r"head"))
    assert not isinstance(model.head.weight, DTensor) and model.head.weight.device == accelerator.device
    assert all(isinstance(p, DTensor) for p in model.blocks.parameters())
    with pytest.raises(ValueError, match="cannot take another"):
        build(plugin())
    from accel.state import reset_state

    reset_state()
    with pytest.raises(ValueError, match="matches no module name"):
        build(plugin(ignored_modules=r"nothing\..*"))
