"""Simulated GPUs hold CUDA tensors: what they report, how tensors get there, and the errors of a GPU.

Each test runs on 2 and 4 simulated GPU ranks; rank k's current GPU is cuda:k.
"""

import re

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_tensors_on_the_simulated_gpu_are_cuda_tensors(rank, world_size):
    here = torch.device("cuda", rank)
    made = {
        "zeros('cuda')": torch.zeros(2, device="cuda"),
        "ones('cuda:k')": torch.ones(2, device=f"cuda:{rank}"),
        "full(device)": torch.full((2,), 3.0, device=torch.device("cuda", rank)),
        "arange": torch.arange(4, device="cuda"),
        "randn": torch.randn(3, device="cuda"),
        "tensor": torch.tensor([1.0, 2.0], device="cuda"),
        "as_tensor": torch.as_tensor([1, 2], device="cuda"),
        ".cuda()": torch.ones(2).cuda(),
        ".to('cuda')": torch.ones(2).to("cuda"),
        ".to(other)": torch.ones(2).to(torch.zeros(1, device="cuda")),
        "zeros_like": torch.zeros_like(torch.ones(2), device="cuda"),
        "new_zeros": torch.ones(2, device="cuda").new_zeros(3),
    }
    for what, tensor in made.items():
        assert tensor.device == here and tensor.is_cuda and not tensor.is_cpu, what
        assert tensor.get_device() == rank, what
    assert repr(torch.ones(2, device="cuda")) == f"tensor([1., 1.], device='cuda:{rank}')"
    # another simulated GPU of this node, by index
    other = (rank + 1) % world_size
    assert torch.ones(1).cuda(other).device == torch.device("cuda", other)
    assert torch.ones(1).to(other).device == torch.device("cuda", other)


@distributed_test(world_size=SIZES, device="cuda")
def test_values_come_back_to_the_host(rank):
    x = torch.arange(3.0, device="cuda") + rank
    host = x.cpu()
    assert type(host) is torch.Tensor and host.device.type == "cpu"
    assert host.tolist() == x.tolist() == [rank, rank + 1.0, rank + 2.0]
    assert x.sum().item() == 3 * rank + 3 and f"{x.max():.1f}" == f"{rank + 2:.1f}"
    with pytest.raises(TypeError, match=re.escape(f"can't convert cuda:{rank} device type tensor to numpy")):
        x.numpy()
    assert x.to("cpu").numpy().tolist() == host.tolist()
    same = x.to("cuda")
    assert same is x and x.cuda() is x and x.to(torch.float32) is x
    assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.cuda.HalfTensor).dtype == torch.float16
    assert x.type("torch.DoubleTensor").device.type == "cpu"
    with pytest.raises(RuntimeError, match=re.escape("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors")):
        x.pin_memory()


@distributed_test(world_size=SIZES, device="cuda")
def test_modules_move_and_train_on_the_gpu(rank):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).cuda()
    for parameter in model.parameters():
        assert isinstance(parameter, torch.nn.Parameter) and parameter.device == torch.device("cuda", rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4).cuda(), torch.randn(16, 1).cuda()
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad.device == torch.device("cuda", rank) for p in model.parameters())
    assert losses[-1] < losses[0]
    assert model.to("cpu")[0].weight.device.type == "cpu"


@distributed_test(world_size=SIZES, device="cuda")
def test_set_device_decides_what_cuda_means(rank, world_size):
    other = (rank + 1) % world_size
    assert torch.cuda.current_device() == rank
    torch.cuda.set_device(other)
    assert torch.zeros(1, device="cuda").device == torch.device("cuda", other)
    assert torch.ones(1).cuda().device.index == other
    with torch.cuda.device(rank):
        assert torch.zeros(1, device="cuda").device.index == rank
    for bad in (world_size, f"cuda:{world_size + 3}"):
        with pytest.raises(RuntimeError, match="^CUDA error: invalid device ordinal"):
            torch.zeros(1, device=bad if isinstance(bad, str) else torch.device("cuda", bad))
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1).to(bad)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(world_size)


# -- device bugs fail with the GPU's messages ------------------------------------------------------------

SAME = "Expected all tensors to be on the same device, but "


def _per_argument(argument, method, rank):
    return (
        f"{SAME}got {argument} is on cpu, different from other tensors on cuda:{rank} "
        f"(when checking argument in method {method})"
    )


def _device_bugs(rank):
    """(what, the buggy code, the exact message a GPU gives)."""
    gpu = torch.device("cuda", rank)
    linear = torch.nn.Linear(3, 2).to(gpu)
    embedding = torch.nn.Embedding(5, 2).to(gpu)
    x = torch.ones(4, 3, device=gpu)
    return [
        ("elementwise", lambda: x + torch.ones(4, 3), f"{SAME}found at least two devices, cuda:{rank} and cpu!"),
        (
            "elementwise, cpu first",
            lambda: torch.ones(4, 3) * x,
            f"{SAME}found at least two devices, cpu and cuda:{rank}!",
        ),
        ("Linear on a CPU batch", lambda: linear(torch.ones(4, 3)), _per_argument("mat1", "wrapper_CUDA_addmm", rank)),
        ("matmul", lambda: torch.mm(x, torch.ones(3, 2)), _per_argument("mat2", "wrapper_CUDA_mm", rank)),
        (
            "cross_entropy with a CPU target",
            lambda: torch.nn.functional.cross_entropy(torch.randn(4, 3, device=gpu), torch.tensor([0, 1, 2, 0])),
            _per_argument("target", "wrapper_CUDA_nll_loss_forward", rank),
        ),
        ("cat", lambda: torch.cat([x, torch.ones(1, 3)]), _per_argument("tensors", "wrapper_CUDA_cat", rank)),
        ("stack", lambda: torch.stack([x, torch.ones(4, 3)]), _per_argument("tensors", "wrapper_CUDA_cat", rank)),
        (
            "index_select",
            lambda: torch.index_select(x, 0, torch.tensor([0, 1])),
            _per_argument("index", "wrapper_CUDA__index_select", rank),
        ),
        (
            "embedding of CPU indices",
            lambda: embedding(torch.tensor([1, 2])),  # a GPU checks inside index_select
            _per_argument("index", "wrapper_CUDA__index_select", rank),
        ),
    ]


@distributed_test(world_size=SIZES, device="cuda")
def test_device_bugs_fail_with_the_gpu_message(rank, world_size):
    for what, bug, message in _device_bugs(rank):
        with pytest.raises(RuntimeError) as info:
            bug()
        assert str(info.value) == message, what
    other = (rank + 1) % world_size
    with pytest.raises(RuntimeError) as info:
        torch.ones(2, device="cuda") + torch.ones(2, device=f"cuda:{other}")
    assert str(info.value) == f"{SAME}found at least two devices, cuda:{rank} and cuda:{other}!"


@distributed_test(world_size=SIZES, device="cuda")
def test_what_a_gpu_allows_is_allowed(rank):
    x = torch.ones(3, device="cuda")
    assert (x + torch.tensor(2.0)).device.index == rank  # 0-dim CPU tensor: a scalar
    assert (x * 2).tolist() == [2.0, 2.0, 2.0]
    assert x[torch.tensor([0, 2])].tolist() == [1.0, 1.0]  # CPU indices
    x[torch.tensor([1])] = 5.0
    assert x.tolist() == [1.0, 5.0, 1.0]
    x.copy_(torch.zeros(3))  # copies cross devices
    assert x.tolist() == [0.0, 0.0, 0.0]
    out = torch.empty(0, device="cuda")
    torch.cat([torch.ones(2, device="cuda"), torch.ones(2, device="cuda")], out=out)
    assert out.shape == (4,) and out.device.index == rank


@distributed_test(world_size=[2], device="cuda")
def test_strided_nested_tensors_are_refused_by_name_and_jagged_ones_work(rank, world_size):
    torch.cuda.set_device(rank)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    x, pad = torch.randn(2, 5, 8), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    fast = torch.nn.TransformerEncoder(layer, 2).cuda().eval()  # eval + padding mask: the nested fast path
    with torch.no_grad(), pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        fast(x.cuda(), src_key_padding_mask=pad.cuda())
    plain = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():
        expected = plain(x, src_key_padding_mask=pad)
        got = plain.cuda()(x.cuda(), src_key_padding_mask=pad.cuda())
    torch.testing.assert_close(got.cpu()[~pad], expected[~pad], rtol=1e-5, atol=1e-5)
    jagged = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged, device="cuda")
    assert jagged.is_cuda and jagged.sin().to_padded_tensor(0.0).sum().item() == pytest.approx(6 * 3 * 0.841471, 1e-5)


@distributed_test(world_size=SIZES, device="cuda")
def test_device_of_makes_the_tensors_gpu_current_for_the_block(rank, world_size):
    # torch's device_of calls torch.cuda._exchange_device (nn.LSTM's flatten_parameters on a CUDA build)
    other = (rank + 1) % world_size
    torch.cuda.set_device(rank)
    with torch.cuda.device_of(torch.ones(1, device=f"cuda:{other}")):
        assert torch.cuda.current_device() == other
        assert torch.zeros(1, device="cuda").device == torch.device("cuda", other)
    assert torch.cuda.current_device() == rank
    assert torch.cuda._exchange_device(-1) == -1 and torch.cuda.current_device() == rank


@distributed_test(world_size=[2, 4], device="cuda")
def test_dlpack_views_share_the_gpu_tensor_and_streams_have_handles(rank):
    x = torch.arange(4.0, device="cuda", requires_grad=True)
    view = torch.from_dlpack(x)  # what libraries exchanging GPU tensors call (its stream handle read first)
    assert view.device == torch.device("cuda", rank) and not view.requires_grad
    with torch.no_grad():
        view[0] = 7.0
    assert x[0].item() == 7.0  # the same memory
    assert torch.utils.dlpack.from_dlpack(torch.ones(2)).device.type == "cpu"  # host tensors as before
    assert torch.cuda.current_stream().cuda_stream == 0  # the default stream's handle is the null stream
    side = torch.cuda.Stream()
    assert side.cuda_stream not in (0, torch.cuda.Stream().cuda_stream)
