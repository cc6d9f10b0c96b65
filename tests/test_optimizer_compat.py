"""`AcceleratedOptimizer.zero_grad` as Accelerate's: default, and optimizers whose zero_grad takes no set_to_none."""

import pytest
import torch

from accel import Accelerator


class PlainZeroGrad(torch.optim.SGD):
    """An optimizer whose zero_grad() takes no arguments (some third-party ones do)."""

    def zero_grad(self):  # type: ignore[override]  # the point of the test
        super().zero_grad(set_to_none=False)


def _stepped(optimizer_class):
    acc = Accelerator()
    model = torch.nn.Linear(2, 1)
    opt = acc.prepare(optimizer_class(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    return model, opt


def test_zero_grad_sets_gradients_to_none_by_default_or_zeroes_them():
    model, opt = _stepped(torch.optim.SGD)
    opt.zero_grad()
    assert model.weight.grad is None
    model(torch.ones(1, 2)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))


def test_zero_grad_of_an_optimizer_without_set_to_none():
    model, opt = _stepped(PlainZeroGrad)
    opt.zero_grad()
    assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))
    with pytest.raises(ValueError, match="takes no set_to_none"):
        opt.zero_grad(set_to_none=True)
