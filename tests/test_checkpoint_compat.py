"""Checkpoints cross between accel and Accelerate 1.15, both ways, on one process and on several ranks.

Each test trains with one library (accumulating gradients over 2 batches), saves a
checkpoint, trains on (the reference), then starts again with fresh objects and a different
RNG in the other library, loads the checkpoint and trains on: weights, the accumulation
step, registered objects and every RNG (python, numpy, torch, the device's) must come
out exactly as in the reference.
"""

import os
import random

import numpy as np
import pytest
import torch
from support import Counter

from harness import distributed_test

pytest.importorskip("accelerate")  # the reference library, a test-only dependency

SAVED_STEPS = 4  # at the end of a window (accumulated gradients are not part of a checkpoint)
MORE_STEPS = 5


def _library(name):
    if name == "accelerate":
        import accelerate

        return accelerate
    import accel

    return accel


def _reset_libraries():
    """Forget both libraries' shared state (the process group, if any, stays)."""
    from accelerate.state import AcceleratorState, GradientState

    from accel.state import reset_state

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    reset_state()


def _build(library, models=1, cpu=False):
    # Accelerate runs several CPU processes only when told cpu=True (its launcher sets that)
    acc = _library(library).Accelerator(gradient_accumulation_steps=2, cpu=cpu)
    torch.manual_seed(0)  # the same initial weights in every run
    nets = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)) for _ in range(models)]
    params = [p for net in nets for p in net.parameters()]
    opt = torch.optim.AdamW(params, lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    *nets, opt, sched = acc.prepare(*nets, opt, sched)
    return acc, nets, opt, sched, counter


def _train(acc, nets, opt, sched, steps):
    for _ in range(steps):
        # data and dropout both draw from the (device) RNG: the continuation depends on its state
        x = torch.randn(4, 4, device=acc.device)
        with acc.accumulate(*nets):
            out = sum(torch.nn.functional.dropout(net(x), p=0.3) for net in nets)
            acc.backward(torch.nn.functional.mse_loss(out, x.sum(dim=1, keepdim=True)))
            opt.step()
            sched.step()
            opt.zero_grad()


def _snapshot(acc, nets):
    weights = [p.detach().cpu().clone() for net in nets for p in acc.unwrap_model(net).parameters()]
    draws = (random.random(), float(np.random.rand()), torch.rand(2), torch.rand(2, device=acc.device).cpu())
    return weights, draws


def _continue_in_other_library(folder, saver, loader, models=1, safe_serialization=True, cpu=False):
    """Reference run with `saver` (saving at SAVED_STEPS), then the resumed run with `loader`."""
    _reset_libraries()
    acc, nets, opt, sched, counter = _build(saver, models, cpu)
    torch.manual_seed(1 + acc.process_index)  # ranks draw different numbers: each restores its own
    _train(acc, nets, opt, sched, SAVED_STEPS)
    counter.count = 42
    acc.save_state(folder, safe_serialization=safe_serialization)
    _train(acc, nets, opt, sched, MORE_STEPS)
    expected_weights, expected_draws = _snapshot(acc, nets)
    expected_lr = sched.get_last_lr()

    _reset_libraries()
    acc, nets, opt, sched, counter = _build(loader, models, cpu)
    torch.manual_seed(1234)  # a new process starts from somewhere else
    random.seed(1234)
    np.random.seed(1234)
    # On simulated GPUs, Accelerate reads onto the CPU: safetensors' direct-to-GPU read needs a real GPU.
    acc.load_state(folder, **({"map_location": "cpu"} if loader == "accelerate" else {}))
    assert acc.step == SAVED_STEPS
    assert counter.count == 42
    _train(acc, nets, opt, sched, MORE_STEPS)
    weights, draws = _snapshot(acc, nets)
    assert sched.get_last_lr() == expected_lr
    for got, want in zip(weights, expected_weights, strict=True):
        assert torch.equal(got, want)
    assert draws[:2] == expected_draws[:2]
    assert torch.equal(draws[2], expected_draws[2]) and torch.equal(draws[3], expected_draws[3])
    _reset_libraries()


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("saver, loader", [("accelerate", "accel"), ("accel", "accelerate")])
def test_checkpoint_crosses_libraries_single_process(tmp_path, saver, loader, safe_serialization):
    _continue_in_other_library(tmp_path / "ckpt", saver, loader, models=2, safe_serialization=safe_serialization)
    model_files = ["model.safetensors", "model_1.safetensors"]
    if not safe_serialization:
        model_files = ["pytorch_model.bin", "pytorch_model_1.bin"]
    expected = [*model_files, "custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(expected)


# Two ranks: Accelerate's first start in a rank costs seconds, four ranks on a 2-core machine half a minute.
# accel's own checkpoints on 2 and 4 ranks: tests/test_save_model.py, tests/multiproc/test_training.py.
@distributed_test(world_size=2, device="cpu", timeout=180)
def test_checkpoint_crosses_libraries_on_several_cpu_ranks(tmp_path, world_size, device):
    _check_crossing_on_ranks(tmp_path, world_size, device)


@distributed_test(world_size=2, device="cuda", timeout=180)
def test_checkpoint_crosses_libraries_on_simulated_gpus(tmp_path, world_size, device):
    _check_crossing_on_ranks(tmp_path, world_size, device)


def _check_crossing_on_ranks(tmp_path, world_size, device):
    # Accelerate adopts the process group the simulated ranks already have.
    _continue_in_other_library(tmp_path / "from_accelerate", "accelerate", "accel", cpu=device == "cpu")
    _continue_in_other_library(tmp_path / "from_accel", "accel", "accelerate", cpu=device == "cpu")
    for folder in ("from_accelerate", "from_accel"):
        names = os.listdir(tmp_path / folder)
        assert {f"random_states_{r}.pkl" for r in range(world_size)} <= set(names)
        assert "model.safetensors" in names


def _stateful_run(library, folder, save_after=None, load=False, shuffle=False):
    """Batches of one epoch from a stateful prepared loader; save after `save_after` of them, or load first."""
    lib = _library(library)
    config = lib.DataLoaderConfiguration(use_stateful_dataloader=True)
    acc = lib.Accelerator(dataloader_config=config)
    data = torch.arange(24.0).reshape(12, 2)
    loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=shuffle, generator=_generator()))
    if load:
        acc.load_state(folder)
    seen = []
    for batch in loader:
        seen.append(batch[:, 0].tolist())
        if len(seen) == save_after:
            acc.save_state(folder)
    return seen


def _generator():
    return torch.Generator().manual_seed(3)


@pytest.mark.parametrize("saver, loader", [("accelerate", "accel"), ("accel", "accelerate")])
def test_stateful_loader_position_crosses_libraries(tmp_path, saver, loader):
    pytest.importorskip("torchdata")
    _reset_libraries()
    full = _stateful_run(saver, tmp_path / "ckpt", save_after=2)
    assert "dl_state_dict.bin" in os.listdir(tmp_path / "ckpt")
    _reset_libraries()
    rest = _stateful_run(loader, tmp_path / "ckpt", load=True)
    _reset_libraries()
    assert rest == full[2:]


def test_shuffled_stateful_loader_resumes_its_order(tmp_path):
    # Accelerate 1.15 draws a new order when it resumes a shuffled stateful loader (its
    # torchdata state does not hold the order); accel continues the saved epoch.
    pytest.importorskip("torchdata")
    full = _stateful_run("accel", tmp_path / "ckpt", save_after=2, shuffle=True)
    _reset_libraries()
    assert _stateful_run("accel", tmp_path / "ckpt", load=True, shuffle=True) == full[2:]
    _reset_libraries()
