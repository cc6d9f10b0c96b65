"""Training through the Accelerator on several ranks, on simulated CPU, CUDA and XLA hardware.

The reference for "the same training" is one process (computed inside each rank, with
no accel) that takes every sample of a step in one batch.
"""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]
DEVICES = ["cpu", "cuda", "xla"]
SAMPLES = 64


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(n=SAMPLES):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)


def _reference_training(global_batch, epochs=1):
    """One process, plain PyTorch: batches of `global_batch` samples in order."""
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(epochs):
        for start in range(0, SAMPLES, global_batch):
            opt.zero_grad()
            torch.nn.functional.mse_loss(
                model(x[start : start + global_batch]), y[start : start + global_batch]
            ).backward()
            opt.step()
    return model


def _params_on_every_rank(accelerator, model):
    """The flattened parameters of each rank, gathered: rows must agree."""
    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    return accelerator.gather(flat.to(accelerator.device)[None]).cpu()


# (accumulation steps, split_batches, mixed precision, tolerance): fp32 agrees to float
# rounding over 16-32 steps; bf16 rounds the forward pass to 8 mantissa bits.
CASES = {
    "fp32": (1, False, "no", 1e-5),
    "fp32-accumulate": (2, False, "no", 1e-5),
    "fp32-split": (1, True, "no", 1e-5),
    "bf16-split-accumulate": (2, True, "bf16", 3e-2),
}


@pytest.mark.parametrize("case", list(CASES))
@distributed_test(world_size=SIZES, device=DEVICES, timeout=120)
def test_training_matches_one_process_with_the_global_batch(world_size, case):
    from torch.utils.data import DataLoader, TensorDataset

    from accel.accelerator import Accelerator

    accumulation, split, precision, tol = CASES[case]
    per_rank = 2
    acc = Accelerator(mixed_precision=precision, gradient_accumulation_steps=accumulation, split_batches=split)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(*_data()), batch_size=per_rank * world_size if split else per_rank)
    model, opt, loader = acc.prepare(model, opt, loader)
    syncs = 0
    for inputs, targets in loader:
        with acc.accumulate(model):
            assert inputs.shape[0] == per_rank
            acc.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            opt.step()
            opt.zero_grad()
            syncs += acc.sync_gradients
    assert syncs == SAMPLES // (per_rank * world_size * accumulation)

    expected = _reference_training(per_rank * world_size * accumulation)
    for p, q in zip(acc.unwrap_model(model).parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=tol, atol=tol)
    rows = _params_on_every_rank(acc, model)
    assert all(torch.equal(rows[0], row) for row in rows)


@distributed_test(world_size=SIZES, device=DEVICES)
def test_fp16_overflow_is_skipped_on_every_rank(rank, world_size):
    from accel.accelerator import Accelerator
    from accel.utils.dataclasses import AutocastKwargs, GradScalerKwargs

    # autocast off: the overflow comes only from the loss this test makes infinite
    acc = Accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=64.0), AutocastKwargs(enabled=False)]
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = _data(8)
    x, y = x.to(acc.device), y.to(acc.device)
    before = _params_on_every_rank(acc, model)

    loss = torch.nn.functional.mse_loss(model(x), y)
    if rank == world_size - 1:
        loss = loss * float("inf")  # one rank overflows; the averaged gradients overflow everywhere
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    assert sched.get_last_lr() == [0.1]
    assert torch.equal(_params_on_every_rank(acc, model), before)

    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    sched.step()
    assert not opt.step_was_skipped
    # a step of N processes is N steps of the one-process schedule
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * 0.5**world_size)
    after = _params_on_every_rank(acc, model)
    assert not torch.equal(after, before)
    assert all(torch.equal(after[0], row) for row in after)


def _train(acc, model, opt, sched, loader, epochs, start_epoch=0, save_at=None, save_dir=None):
    """Train from `start_epoch`; with `save_at`, save a checkpoint after that many batches."""
    batches = 0
    for _ in range(start_epoch, epochs):
        for inputs, targets in loader:
            with acc.accumulate(model):
                # dropout draws from the torch RNG, so the continuation depends on its state too
                out = torch.nn.functional.dropout(model(inputs), p=0.2)
                acc.backward(torch.nn.functional.mse_loss(out, targets))
                opt.step()
                sched.step()
                opt.zero_grad()
            batches += 1
            if batches == save_at:
                acc.save_state(save_dir)


def _checkpoint_setup():
    from torch.utils.data import DataLoader, TensorDataset

    from accel.accelerator import Accelerator
    from accel.utils import set_seed

    set_seed(3)
    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    # The loader's own generator: plain DataLoader iteration otherwise draws a seed from
    # the global RNG, once more in a resumed run than in an uninterrupted one.
    loader = DataLoader(TensorDataset(*_data()), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    return acc, *acc.prepare(model, opt, sched, loader)


@distributed_test(world_size=SIZES, device=DEVICES, timeout=120)
def test_checkpoint_mid_epoch_then_identical_continuation(tmp_path, world_size):
    batches_per_epoch = SAMPLES // (4 * world_size)
    # half-way through the second epoch, at the end of an accumulation window
    stop = batches_per_epoch + batches_per_epoch // 2

    acc, model, opt, sched, loader = _checkpoint_setup()
    _train(acc, model, opt, sched, loader, epochs=3, save_at=stop, save_dir=tmp_path / "ckpt")
    uninterrupted = _params_on_every_rank(acc, model)

    # A new run: fresh objects and RNG, then the checkpoint; the loader resumes mid-epoch.
    torch.manual_seed(1234)
    acc, model, opt, sched, loader = _checkpoint_setup()
    acc.load_state(tmp_path / "ckpt")
    _train(acc, model, opt, sched, loader, epochs=3, start_epoch=1)
    resumed = _params_on_every_rank(acc, model)
    # The resumed DDP reduces its first synchronised step with its buckets in parameter
    # order (they are rebuilt in gradient order after it), so ranks are summed in another
    # order there: on 4 ranks the weights may differ by float rounding.
    torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=1e-6)


@distributed_test(world_size=SIZES, device=DEVICES)
def test_uneven_inputs_are_joined(rank, world_size):
    from accel.accelerator import Accelerator

    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    x, y = _data()
    x, y = x.to(acc.device), y.to(acc.device)
    batches = 2 + rank  # every rank a different number of batches
    with acc.join_uneven_inputs([model]):
        for i in range(batches):
            acc.backward(torch.nn.functional.mse_loss(model(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]))
            opt.step()
            opt.zero_grad()
    # everyone got here (no hang), and the models agree again after the join
    rows = _params_on_every_rank(acc, model)
    assert all(torch.allclose(rows[0], row) for row in rows)
    assert not torch.equal(rows[0], torch.cat([p.detach().reshape(-1) for p in _model().parameters()]))


@distributed_test(world_size=SIZES, device=DEVICES)
def test_clipping_sees_the_gradients_of_the_global_batch(rank, world_size):
    from accel.accelerator import Accelerator

    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    x, y = _data(4 * world_size)
    mine = slice(4 * rank, 4 * rank + 4)
    acc.backward(torch.nn.functional.mse_loss(model(x[mine].to(acc.device)), y[mine].to(acc.device)))
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()

    reference = _model()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    torch.optim.SGD(reference.parameters(), lr=0.05).step()
    torch.testing.assert_close(norm.cpu(), expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(acc.unwrap_model(model).parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


@distributed_test(world_size=SIZES, device=DEVICES)
def test_join_with_uneven_batches_from_a_prepared_loader(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset

    from accel.accelerator import Accelerator

    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # 4 * world_size + 1 samples in batches of 1: rank 0 has one batch more than the others
    x, y = _data(4 * world_size + 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=1)
    model, opt, loader = acc.prepare(model, opt, loader)
    seen = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        for inputs, targets in loader:
            acc.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            opt.step()
            opt.zero_grad()
            seen += 1
    assert seen == (5 if rank == 0 else 4)
    assert acc.even_batches and loader.batch_sampler.even_batches  # restored after the block
    assert len(list(loader)) == 5  # even again: every rank 5 batches
    rows = _params_on_every_rank(acc, model)
    assert all(torch.allclose(rows[0], row) for row in rows)


@distributed_test(world_size=SIZES, device=DEVICES, timeout=120)
def test_scheduler_learning_rates_equal_accelerates_under_accumulation(world_size):
    """Our prepared scheduler and Accelerate 1.15's `AcceleratedScheduler`, stepped side by side on every batch.

    (`split_batches=True` is compared in tests/test_scheduler_compat.py, in one process.)
    """
    import types

    accelerate_scheduler = pytest.importorskip("accelerate.scheduler")
    from accelerate.state import GradientState as PeerGradientState
    from torch.utils.data import DataLoader, TensorDataset

    from accel.accelerator import Accelerator

    acc = Accelerator(gradient_accumulation_steps=3)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    loader = DataLoader(TensorDataset(*_data(24 * world_size)), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    # The peer's scheduler over a twin schedule. It reads the number of processes from
    # its own AcceleratorState, which is not running here: answer for it.
    twin_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    twin = torch.optim.lr_scheduler.LambdaLR(twin_opt, lambda s: 1.0 / (s + 1))
    original_state = accelerate_scheduler.AcceleratorState
    accelerate_scheduler.AcceleratorState = lambda: types.SimpleNamespace(num_processes=world_size)
    try:
        peer = accelerate_scheduler.AcceleratedScheduler(twin, opt)
        peer_gradient_state = PeerGradientState()
        ours, theirs = [], []
        for inputs, targets in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(inputs), targets))
                opt.step()
                sched.step()
                peer_gradient_state.sync_gradients = acc.sync_gradients  # its setter would start its XLA state
                peer.step()
                opt.zero_grad()
            ours.append(sched.get_last_lr()[0])
            theirs.append(peer.get_last_lr()[0])
    finally:
        accelerate_scheduler.AcceleratorState = original_state
        PeerGradientState._reset_state()
    assert len(ours) == 12 and ours == pytest.approx(theirs, rel=1e-12)
    # 4 optimizer steps, each advancing once per process
    assert sched.scheduler.last_epoch == 4 * world_size


@distributed_test(world_size=SIZES, device=["cpu", "cuda"])
def test_join_warns_where_accelerate_warns(world_size):
    """A model that is not DDP, and an iterable loader under an even_batches override: warnings, no error."""
    from torch.utils.data import DataLoader, IterableDataset

    from accel.accelerator import Accelerator

    class Numbers(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(4 * world_size, dtype=torch.float32))

    acc = Accelerator()
    model, loader = acc.prepare(_model(), DataLoader(Numbers(), batch_size=2))
    with (
        pytest.warns(UserWarning, match="none was given: joining is only supported for multi-GPU"),
        acc.join_uneven_inputs([acc.unwrap_model(model)]),
    ):
        pass
    with (
        pytest.warns(UserWarning, match="left as they are: DataLoader"),
        acc.join_uneven_inputs([model], even_batches=False),
    ):
        assert len(list(loader)) == 2
    assert acc.even_batches
