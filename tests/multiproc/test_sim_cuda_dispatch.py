"""The two paths an op on simulated CUDA tensors takes agree with a GPU.

Most ops (no keyword arguments, all tensors on one simulated GPU, reshaping no argument)
take a short path in the core wrapper's `__torch_dispatch__`; the rest take the
general one. These tests run ops on both sides of that line.
"""

import pytest
import torch

from harness import distributed_test


@distributed_test(world_size=[2], device="cuda")
def test_lists_of_tensors_stay_on_their_gpu(rank, world_size):
    here = torch.device("cuda", rank)
    params = [torch.ones(3, device="cuda"), torch.full((2,), 2.0, device="cuda")]
    torch._foreach_mul_(params, 3.0)  # in-place foreach: returns nothing, writes into each
    assert [p.tolist() for p in params] == [[3.0, 3.0, 3.0], [6.0, 6.0]]
    roots = torch._foreach_sqrt(params)
    assert [r.device for r in roots] == [here, here]
    assert [round(v, 4) for v in roots[1].tolist()] == [2.4495, 2.4495]
    joined = torch.cat((params[0], params[1]))  # a tuple of tensors
    assert joined.device == here and joined.tolist() == [3.0, 3.0, 3.0, 6.0, 6.0]
    other = torch.ones(2, device=f"cuda:{(rank + 1) % world_size}")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.cat([params[1], other])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add_(params, [params[0], torch.ones(2)])


@distributed_test(world_size=[2], device="cuda")
def test_an_op_writing_into_an_argument_returns_that_very_tensor(rank):
    x = torch.ones(2, 3, device="cuda")
    assert x.add_(1) is x and x.tolist() == [[2.0] * 3] * 2
    out = torch.empty(0, device="cuda")
    assert torch.add(x, x, out=out) is out and out.shape == (2, 3)
    assert x.t_() is x and x.shape == (3, 2) and x.stride() == (1, 3)


@distributed_test(world_size=[2], device="cuda")
def test_results_in_tuples_and_random_draws(rank):
    x = torch.tensor([[1.0, 5.0], [4.0, 2.0]], device="cuda")
    values, indices = torch.max(x, 0)
    assert values.device == indices.device == torch.device("cuda", rank)
    assert values.tolist() == [4.0, 5.0] and indices.tolist() == [1, 0]
    cpu_state = torch.get_rng_state()
    big = torch.ones(1000, device="cuda")
    torch.cuda.manual_seed(3)
    first = torch.nn.functional.dropout(big, 0.5)
    torch.cuda.manual_seed(3)
    second = torch.nn.functional.dropout(big, 0.5)
    assert torch.equal(first.cpu(), second.cpu()) and first.device == big.device
    assert torch.equal(torch.get_rng_state(), cpu_state)  # drawn from the GPU's generator, not the CPU one


@distributed_test(world_size=2, device="cuda")
def test_composite_ops_below_autograd_decompose_as_on_a_gpu(rank):
    # under inference_mode (and inside another subclass's __torch_dispatch__) composite ops
    # such as `to.device` reach the simulated GPU whole: they must give one CUDA tensor
    x = torch.ones(3, device="cuda")
    with torch.inference_mode():
        y = x.int().to(x)
        z = x.to(f"cuda:{rank}", torch.float64)
    assert type(y._inner) is torch.Tensor and type(z._inner) is torch.Tensor
    assert y.dtype == torch.float32 and z.dtype == torch.float64 and z.device == x.device
    out = torch.where(torch.tensor([True, False, True], device="cuda"), y, 0)
    assert out.tolist() == [1.0, 0.0, 1.0]


@distributed_test(world_size=2, device="cuda")
def test_attention_takes_a_fused_kernel_as_on_a_gpu(rank):
    # fp32 without a mask: memory-efficient attention, as a GPU takes it (flash needs fp16/bf16);
    # computed by the CPU's flash kernel, forward and backward
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    gq, gk, gv = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.device == torch.device("cuda", rank) and torch.equal(out.cpu(), ref)
    assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
    out.sum().backward()
    ref.sum().backward()
    for gpu, cpu in ((gq, q), (gk, k), (gv, v)):
        assert gpu.grad.device == gpu.device and torch.equal(gpu.grad.cpu(), cpu.grad)
    # with a mask: torch's math path, as a GPU without a fused kernel for it
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    masked = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=mask.cuda())
    assert torch.allclose(masked.cpu(), F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        F.scaled_dot_product_attention(gq, gk, gv, attn_mask=torch.ones(16, 16))


@distributed_test(world_size=2, device="cuda")
def test_index_tensors_on_another_gpu_fail_as_on_a_gpu(rank):
    x = torch.arange(12.0, device="cuda:0").reshape(3, 4)
    elsewhere = torch.tensor([0, 2], device="cuda:1")
    words = r"indices should be either on cpu or on the same device as the indexed tensor \(cuda:0\)"
    with pytest.raises(RuntimeError, match=words):
        x[elsewhere]  # the index list starts with the tensor
    with pytest.raises(RuntimeError, match=words):
        x[:, elsewhere]  # the index list starts with None: the short path must not take it
    assert x[:, elsewhere.cpu()].tolist() == x[:, elsewhere.to("cuda:0")].tolist() == [[0, 2], [4, 6], [8, 10]]


@distributed_test(world_size=[2], device="cuda")
def test_torchscript_compiles_torch_tensor_as_the_builtin(rank):
    # torch.distributed.optim's optimizers are @torch.jit.script classes calling torch.tensor,
    # which the simulator replaces: TorchScript must still see the aten op
    import torch.distributed.optim

    @torch.jit.script
    def both(x: float) -> torch.Tensor:
        return torch.tensor([x]) + torch.as_tensor([x])

    assert both(1.5).tolist() == [3.0]


@distributed_test(world_size=[2], device="cuda")
def test_a_dtensor_moved_to_its_own_device_is_itself(rank):
    # torch's clip_grad_norm_ calls norm.to(device) on partial DTensors: a copy would all-reduce again
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    mesh = init_device_mesh("cuda", (2,))
    partial = distribute_tensor(torch.ones(4, device="cuda"), mesh, [Partial()])
    assert partial.to(partial.device) is partial
    assert partial.to("cuda") is partial
    assert partial.to(torch.float32) is partial
    moved = partial.to(torch.float64)
    assert moved is not partial and moved.dtype == torch.float64
