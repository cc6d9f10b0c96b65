"""The Accelerator's multi-process plumbing: DDP options, triggers, saving, checkpoint files."""

import os

import pytest
import torch

from harness import distributed_test


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@distributed_test(world_size=2, device=["cpu", "cuda", "xla"])
def test_model_wrapping_follows_the_backend_and_ddp_kwargs(rank):
    from torch.nn.parallel import DistributedDataParallel

    from accel.accelerator import Accelerator
    from accel.utils.dataclasses import DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(bucket_cap_mb=1, comm_hook="fp16")
    acc = Accelerator(kwargs_handlers=[handler])
    model = acc.prepare(_model())
    if acc.state.hardware.supports_join():  # the DDP backends
        assert isinstance(model, DistributedDataParallel)
        assert model.bucket_bytes_cap == 1024 * 1024
        assert [hook.__qualname__ for hook, _ in model._comm_hooks] == ["fp16_compress_hook"]
    else:
        assert not isinstance(model, DistributedDataParallel)  # XLA reduces in the optimizer step
    assert acc.unwrap_model(model).__class__ is torch.nn.Sequential
    frozen = acc.prepare(torch.nn.Linear(2, 2).requires_grad_(False))
    assert not isinstance(frozen, DistributedDataParallel)  # nothing to synchronise


@distributed_test(world_size=[2, 4], device="cpu")
def test_trigger_set_on_one_rank_is_seen_by_all(rank, world_size):
    from accel.accelerator import Accelerator

    acc = Accelerator()
    assert acc.check_trigger() is False
    if rank == world_size - 1:
        acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False


@distributed_test(world_size=2, device=["cpu", "xla"])
def test_save_writes_once_and_save_state_writes_every_rank(rank, world_size, tmp_path):
    from accel.accelerator import Accelerator

    acc = Accelerator()
    acc.save({"rank": torch.tensor(rank, device=acc.device)}, tmp_path / "obj.pt")
    acc.wait_for_everyone()
    assert torch.load(tmp_path / "obj.pt")["rank"].item() == 0
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(rank)  # a different RNG on each rank, restored per rank
    folder = acc.save_state(tmp_path / "ckpt")
    expected = torch.rand(3)
    assert sorted(os.listdir(folder)) == ["model.safetensors", "optimizer.bin"] + [
        f"random_states_{r}.pkl" for r in range(world_size)
    ]
    acc.load_state(folder)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("sync_each_batch", [False, True])
@distributed_test(world_size=2, device=["cpu", "cuda"])
def test_accumulate_skips_ddp_sync_inside_a_window_unless_sync_each_batch(rank, sync_each_batch):
    from accel.accelerator import Accelerator
    from accel.utils.dataclasses import GradientAccumulationPlugin

    acc = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    )
    model = acc.prepare(_model())
    seen = []
    for _ in range(4):
        with acc.accumulate(model):
            seen.append((acc.sync_gradients, model.require_backward_grad_sync))
            acc.backward(model(torch.randn(2, 4, device=acc.device)).sum())
    window = [False, True, False, True]
    assert [s for s, _ in seen] == window
    assert [d for _, d in seen] == ([True] * 4 if sync_each_batch else window)
