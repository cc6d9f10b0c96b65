"""The prepared scheduler against Accelerate 1.15's, run side by side in one process.

Both libraries train the same model on the same data with the same schedule; the
learning rate after every batch must be the same, with and without gradient
accumulation, with and without `split_batches`.
"""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")

SCHEDULES = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
    # short enough that accumulation runs past its end: both stop at the last step
    "one-cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5),
    "linear": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=6),
}


def _reset(library):
    if library == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    else:
        from accel.state import reset_state

        reset_state()


def learning_rates(library, schedule, accumulation, split_batches, batches=12):
    """The learning rate after each batch of a small training run through `library`'s Accelerator."""
    if library == "accelerate":
        from accelerate import Accelerator
    else:
        from accel import Accelerator
    _reset(library)
    try:
        acc = Accelerator(gradient_accumulation_steps=accumulation, split_batches=split_batches, cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = SCHEDULES[schedule](opt)
        loader = DataLoader(TensorDataset(torch.randn(batches * 2, 3)), batch_size=2)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        rates = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "scheduler stepped before optimizer" inside windows
            for (x,) in loader:
                with acc.accumulate(model):
                    acc.backward(model(x).pow(2).mean())
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                rates.append(sched.get_last_lr()[0])
        return rates, sched.state_dict()["last_epoch"]
    finally:
        _reset(library)


@pytest.mark.parametrize("split_batches", [False, True], ids=["per-process", "split"])
@pytest.mark.parametrize("accumulation", [1, 2, 3])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_learning_rates_equal_accelerates_step_by_step(schedule, accumulation, split_batches):
    ours = learning_rates("accel", schedule, accumulation, split_batches)
    theirs = learning_rates("accelerate", schedule, accumulation, split_batches)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-12, abs=1e-15)
    assert ours[1] == theirs[1]


def test_accumulation_advances_once_per_optimizer_step():
    rates, last_epoch = learning_rates("accel", "step", accumulation=3, split_batches=False)
    # 12 batches, windows of 3: 4 optimizer steps, each halving the rate once, at the end of its window
    assert last_epoch == 4
    assert rates == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125, 0.0625]
