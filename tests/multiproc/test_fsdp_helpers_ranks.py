"""Accelerate's FSDP checkpoint helpers on 2 and 4 simulated GPUs: save_fsdp_model / load_fsdp_model,
save_fsdp_optimizer / load_fsdp_optimizer (sharded and full), merge_fsdp_weights and `accel merge-weights` on
what they wrote, and a model prepared before its optimizer."""

import os

import pytest
import torch
from torch import nn

from harness import distributed_test
from tests.multiproc.test_fsdp_accelerator import SIZES, Net, assert_close_to, build, data, plugin, reference, train


@distributed_test(world_size=SIZES, device="cuda")
@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp_model_and_optimizer_round_trip(rank, world_size, tmp_path, kind):
    from accel.state import reset_state
    from accel.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

    fsdp_plugin = plugin(state_dict_type=kind)
    accelerator, model, optimizer = build(fsdp_plugin, momentum=0.9)
    train(accelerator, model, optimizer, rank, world_size, steps=2)
    folder = tmp_path / "ckpt"
    save_fsdp_model(fsdp_plugin, accelerator, model, folder)
    save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, folder)
    accelerator.wait_for_everyone()
    names = set(os.listdir(folder))
    assert names == (
        {"pytorch_model_fsdp_0", "optimizer_0"}
        if kind == "SHARDED_STATE_DICT"
        else {
            "pytorch_model_fsdp.bin",
            "optimizer.bin",
        }
    )
    train(accelerator, model, optimizer, rank, world_size, steps=2, start=2)
    expected = accelerator.get_state_dict(model)

    reset_state()
    fsdp_plugin = plugin(state_dict_type=kind)
    torch.manual_seed(5)
    accelerator, model, optimizer = build(fsdp_plugin, momentum=0.9)
    # Accelerate's loader also takes the distributed checkpoint's own folder
    where = folder / "pytorch_model_fsdp_0" if kind == "SHARDED_STATE_DICT" else folder
    load_fsdp_model(fsdp_plugin, accelerator, model, where)
    load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, folder)
    train(accelerator, model, optimizer, rank, world_size, steps=2, start=2)  # momentum restored: same steps
    resumed = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(resumed, expected)


@distributed_test(world_size=SIZES, device="cuda")
def test_merge_fsdp_weights_of_a_sharded_save(rank, world_size, tmp_path):
    from safetensors.torch import load_file

    from accel.utils import merge_fsdp_weights, save_fsdp_model, save_fsdp_optimizer

    fsdp_plugin = plugin(state_dict_type="SHARDED_STATE_DICT")
    accelerator, model, optimizer = build(fsdp_plugin, momentum=0.9)
    train(accelerator, model, optimizer, rank, world_size, steps=2)
    save_fsdp_model(fsdp_plugin, accelerator, model, tmp_path)
    save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, tmp_path)
    accelerator.wait_for_everyone()
    expected = accelerator.get_state_dict(model)

    merge_fsdp_weights(tmp_path / "pytorch_model_fsdp_0", tmp_path / "merged")  # every rank calls it
    assert os.listdir(tmp_path / "merged") == ["model.safetensors"]  # written once, seen by all after the call
    if rank == 0:
        assert_close_to(load_file(tmp_path / "merged" / "model.safetensors"), expected)
    # the optimizer's checkpoint (nested, not tensors only): torch.save, and the sharded folder removed after
    merge_fsdp_weights(
        tmp_path / "optimizer_0", tmp_path / "optim", safe_serialization=False, remove_checkpoint_dir=True
    )
    assert not (tmp_path / "optimizer_0").exists()
    if rank == 0:
        merged = torch.load(tmp_path / "optim" / "pytorch_model.bin", weights_only=True)
        assert merged["param_groups"][0]["momentum"] == 0.9
        buffers = merged["state"]
        assert sorted(buffers) == sorted(expected)
        assert all(buffers[name]["momentum_buffer"].shape == expected[name].shape for name in buffers)
    accelerator.wait_for_everyone()


@distributed_test(world_size=SIZES, device="cuda")
def test_a_model_prepared_before_its_optimizer(rank, world_size):
    from torch.distributed.tensor import DTensor

    from accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=plugin())
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # over the parameters before sharding
    model = accelerator.prepare(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    optimizer = accelerator.prepare(optimizer)  # pointed at the shards now
    assert all(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
    assert model is accelerator.prepare(model)  # a sharded model is not sharded again
    train(accelerator, model, optimizer, rank, world_size, steps=3)
    state = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(state, reference(3, world_size))


@distributed_test(world_size=2, device="cuda")
def test_an_optimizer_that_stepped_before_its_model_was_sharded_is_refused(rank):
    from accel import Accelerator

    accelerator = Accelerator(fsdp_plugin=plugin())
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data(2, 1)
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    optimizer.step()
    model = accelerator.prepare(model)
    with pytest.raises(ValueError, match="prepare the model and the optimizer before the first optimizer step"):
        accelerator.prepare(optimizer)


@distributed_test(world_size=SIZES, device="cuda")
@pytest.mark.parametrize("minimum", [0, 60])
def test_size_based_wrapping_needs_a_minimum(rank, world_size, minimum):
    # as Accelerate: SIZE_BASED_WRAP without min_num_params shards the root alone; with one, the larger blocks
    from torch.distributed.fsdp import FSDPModule

    accelerator, model, optimizer = build(plugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=minimum))
    assert isinstance(model, FSDPModule)
    assert all(isinstance(b, FSDPModule) == bool(minimum) for b in model.blocks)  # 144 parameters a block
    assert not isinstance(model.head, FSDPModule)  # 9 parameters
    train(accelerator, model, optimizer, rank, world_size, steps=2)
    state = accelerator.get_state_dict(model)
    if rank == 0:
        assert_close_to(state, reference(2, world_size))
