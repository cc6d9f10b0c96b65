"""`torch.autocast("cuda")` applies CUDA's policy on simulated GPUs; `GradScaler("cuda")` scales, skips and adapts."""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@distributed_test(world_size=SIZES, device="cuda")
def test_autocast_applies_cuda_policy(rank, dtype):
    linear = torch.nn.Linear(4, 3).cuda()
    norm = torch.nn.LayerNorm(3).cuda()
    x = torch.randn(5, 4, device="cuda")
    target = torch.tensor([0, 1, 2, 0, 1], device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        logits = linear(x)  # lower precision list (addmm)
        product = x @ x.T  # matmul
        normed = norm(logits)  # float32 list
        probabilities = torch.softmax(logits, dim=-1)
        loss = torch.nn.functional.cross_entropy(logits, target)
        summed = torch.sum(logits)  # fp32_opt: float32 output unless a dtype was given
        promoted = torch.addcmul(torch.ones(5, 3, device="cuda"), logits, logits)  # widest input type
        host = torch.ones(2, 2) @ torch.ones(2, 2)  # autocast("cuda") leaves CPU tensors alone
        with torch.autocast("cuda", enabled=False):
            untouched = linear(x)
    assert logits.dtype == product.dtype == dtype and logits.device.index == rank
    assert normed.dtype == probabilities.dtype == loss.dtype == summed.dtype == torch.float32
    assert promoted.dtype == torch.float32 and host.dtype == torch.float32 and untouched.dtype == torch.float32
    loss.backward()
    assert linear.weight.grad.dtype == torch.float32 and linear.weight.grad.device.index == rank
    assert linear(x).dtype == torch.float32  # autocast is over


@distributed_test(world_size=SIZES, device="cuda")
def test_autocast_policy_is_the_one_torch_declares_for_cuda():
    from accel.sim.core import torch_internals

    lists = torch_internals.autocast_op_lists()
    lower = {name for name, _ in lists["lower"]}
    fp32 = {name for name, _ in lists["fp32"]}
    assert {"addmm", "mm", "conv2d", "bmm", "linear"} <= lower
    assert {"layer_norm", "nll_loss", "mse_loss"} <= fp32
    assert {"softmax", "log_softmax", "sum"} <= {name for name, _ in lists["fp32_opt"]}
    assert {"addcmul", "index_put"} <= {name for name, _ in lists["promote"]}
    x = torch.randn(3, 3, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.mm(x, x).dtype == torch.float16
        assert torch.nn.functional.mse_loss(x.half(), x.half()).dtype == torch.float32


@distributed_test(world_size=SIZES, device="cuda")
def test_grad_scaler_scales_unscales_skips_and_adapts(rank):
    model = torch.nn.Linear(2, 1, bias=False).cuda()
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=2)
    x = torch.ones(1, 2, device="cuda")

    def step(poison=False):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().sum()
        scaled = scaler.scale(loss)
        assert scaled.item() == loss.item() * scaler.get_scale() and scaled.device.index == rank
        scaled.backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        unscaled = model.weight.grad.clone()
        scaler.step(optimizer)
        scaler.update()
        return unscaled

    grad = step()
    assert grad.tolist() == [[1.0, 1.0]]  # unscaled back to d(loss)/dw
    assert torch.allclose(model.weight.cpu(), torch.full((1, 2), 0.9))
    before = model.weight.detach().clone()
    step(poison=True)  # inf in a gradient: the step is skipped, the scale backs off
    assert torch.equal(model.weight.detach(), before) and scaler.get_scale() == 512.0
    step()
    step()  # two finite steps in a row: the scale grows
    assert scaler.get_scale() == 1024.0
