"""RMSNorm on simulated GPUs takes CUDA's fused kernel, as torch's `rms_norm` does on a CUDA device
(`_fused_rms_norm`, backward `FusedRmsNormBackward0`), also for DTensors, whose sharding rules exist for the
fused op only; the host's written-out version keeps more for backward and cannot take a partial mean in place."""

import torch
import torch.nn.functional as F

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_rms_norm_runs_the_fused_kernel_with_the_hosts_values_and_gradients(rank, world_size):
    torch.manual_seed(rank)
    x, w = torch.randn(6, 32), torch.randn(32)
    gx, gw = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    before = torch.cuda.memory_allocated()
    y = F.rms_norm(gx, (32,), gw, 1e-6)
    assert type(y.grad_fn).__name__ == "FusedRmsNormBackward0"
    # kept for backward: the output (6 x 32 fp32) and the rstd (6 x 1 fp32), each in a 512-byte block
    assert torch.cuda.memory_allocated() - before == 2 * 512 + 512 * ((6 * 32 * 4 - 1) // 512)
    hx, hw = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.rms_norm(hx, (32,), hw, 1e-6)
    torch.testing.assert_close(y.cpu(), want)
    (y * y).sum().backward()
    (want * want).sum().backward()
    torch.testing.assert_close(gx.grad.cpu(), hx.grad)
    torch.testing.assert_close(gw.grad.cpu(), hw.grad)
    with torch.inference_mode():
        torch.testing.assert_close(F.rms_norm(x.cuda(), (32,), w.cuda(), 1e-6).cpu(), want.detach())


@distributed_test(world_size=SIZES, device="cuda")
def test_rms_norm_of_a_dtensor_sharded_on_the_normalized_dim(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8 * world_size)
    norm = distribute_module(torch.nn.RMSNorm(8 * world_size).cuda(), mesh)  # its weight replicated
    sharded = distribute_tensor(x.cuda(), mesh, [Shard(2)]).requires_grad_()
    out = norm(sharded)
    want_in = x.clone().requires_grad_()
    want = torch.nn.RMSNorm(8 * world_size)(want_in)
    torch.testing.assert_close(out.full_tensor().cpu(), want.detach())
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(sharded.grad.full_tensor().cpu(), want_in.grad)
