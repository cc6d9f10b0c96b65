"""XLA tensors on simulated TPU cores: programs written as torch_xla's docs write them.

Each rank of `device="xla"` is a PJRT process driving one TPU core, which it sees as
`xla:0`; its tensors are XLA tensors (data computed by CPU kernels), and the mistakes
that fail on a TPU fail here with torch_xla's messages.
"""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="xla")
def test_each_process_drives_xla_0(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    assert device == torch.device("xla", 0) == xm.xla_device()  # one device per process, as under PJRT
    assert (xr.global_ordinal(), xr.world_size()) == (rank, world_size)

    t = torch.randn(3, 4, device=device)
    assert t.device == device and t.is_xla and not t.is_cpu and not t.is_cuda
    assert t.device.type == "xla" and t.get_device() == 0
    assert "device='xla:0'" in repr(t) and "simxla" not in repr(t) + str(t.untyped_storage().device)
    assert t.type() == "torch.xla.FloatTensor"
    assert torch.zeros(2, device="xla").device == device
    assert torch.tensor([1, 2], device=device).device == device
    assert torch.arange(4, device=device).tolist() == [0, 1, 2, 3]

    host = torch.ones(3)
    moved = host.to(device)
    assert moved.device == device and moved.to(device) is moved and moved.to("xla") is moved
    back = moved.cpu()
    assert back.device == torch.device("cpu") and type(back) is torch.Tensor and back.numpy().tolist() == [1, 1, 1]

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)
    assert all(p.device == device and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    loss = model(t).square().mean()
    loss.backward()
    assert loss.device == device and all(p.grad.device == device for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    xm.mark_step()
    torch_xla.sync()
    assert all(p.device == device for p in model.parameters())
    assert f"{loss.item():.3f}" == f"{loss:.3f}"


@distributed_test(world_size=SIZES, device="xla")
def test_tpu_bugs_fail_with_torch_xla_messages(rank):
    import torch_xla

    device = torch_xla.device()
    model = torch.nn.Linear(4, 2).to(device)
    batch = torch.randn(3, 4)

    # the batch left on the host
    with pytest.raises(RuntimeError, match=r"^Expected XLA tensor\. Got: CPUFloatType$"):
        model(batch)
    # a CPU tensor made inside forward
    with pytest.raises(RuntimeError, match=r"^Expected XLA tensor\. Got: CPUFloatType$"):
        torch.matmul(batch.to(device), torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="Element at index 1 is not an XLA tensor. Got: CPULongType"):
        torch.cat([torch.ones(2, dtype=torch.long, device=device), torch.ones(2, dtype=torch.long)])
    # .numpy() on the device
    with pytest.raises(TypeError, match=r"can't convert xla:0 device type tensor to numpy\. Use Tensor\.cpu\(\)"):
        model.weight.detach().numpy()

    # what torch_xla accepts: a 0-dim CPU tensor (a wrapped number), a CPU operand of the
    # binary arithmetic ops (moved onto the device), CPU index tensors
    x = batch.to(device)
    assert (x * torch.tensor(2.0)).device == device
    assert (x + torch.ones(3, 4)).device == device
    assert x[torch.tensor([0, 2])].shape == (2, 4)


@distributed_test(world_size=SIZES, device="xla")
def test_rng_is_the_devices_own_seed(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    xm.set_rng_state(1234)
    assert xm.get_rng_state() == 1234
    first = torch.randn(4, device=device)
    assert xm.get_rng_state() != 1234  # the running seed moves on, as XLA's does
    xm.set_rng_state(1234)
    torch.manual_seed(999)  # the host's generator: not the TPU's
    again = torch.randn(4, device=device)
    assert torch.equal(first.cpu(), again.cpu())
    dropped = torch.nn.functional.dropout(torch.ones(1000, device=device), p=0.5)
    assert dropped.device == device and 300 < int((dropped == 0).sum()) < 700


@distributed_test(world_size=SIZES, device="xla")
def test_autocast_on_xla_uses_torch_xlas_tpu_policy(rank):
    import torch_xla

    device = torch_xla.device()
    model = torch.nn.Linear(4, 4).to(device)
    x = torch.randn(2, 4, device=device)
    with torch.autocast("xla", dtype=torch.bfloat16):
        hidden = model(x)
        assert hidden.dtype == torch.bfloat16 and hidden.device == device  # linear: lower precision
        assert torch.relu(x).dtype == torch.bfloat16  # relu is on XLA's lower-precision list
        assert torch.softmax(hidden, dim=-1).dtype == torch.float32  # softmax: fp32
        assert torch.cat([hidden, x]).dtype == torch.float32  # cat: the widest input
    assert model(x).dtype == torch.float32


@distributed_test(world_size=SIZES, device="xla")
def test_checkpoints_of_xla_tensors(rank, tmp_path):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    model = torch.nn.Linear(3, 2).to(device)
    path = tmp_path / f"model{rank}.pt"
    torch.save(model.state_dict(), path)  # pickled as torch pickles XLA tensors: data and device
    loaded = torch.load(path, weights_only=False)
    assert all(t.device == device for t in loaded.values())
    xm.save(model.state_dict(), tmp_path / "xm.pt")  # moved to the CPU first, written by the master
    xm.rendezvous("saved")
    on_host = torch.load(tmp_path / "xm.pt")
    assert all(t.device == torch.device("cpu") for t in on_host.values())


@distributed_test(world_size=SIZES, device="xla")
def test_empty_tensors_are_zeros_as_xla_makes_them(rank):
    import torch_xla

    device = torch_xla.device()
    full = torch.full((64,), 7.0, device=device)
    made = {
        "empty": torch.empty(64, device=device),
        "empty_strided": torch.empty_strided((8, 8), (1, 8), device=device),
        "empty_like": torch.empty_like(full),
        "new_empty": full.new_empty(64),
        "new_empty_strided": full.new_empty_strided((8, 8), (8, 1)),
    }
    for name, tensor in made.items():
        assert tensor.device == device and tensor.is_xla, name
        assert tensor.abs().sum().item() == 0, name  # XLA lowers empty to a full of zeros
    assert made["empty_strided"].stride() == (1, 8)
    assert torch.empty(4).to(device).device == device  # a host tensor moved on still holds its own values


@distributed_test(world_size=SIZES, device="xla")
def test_data_swaps_between_xla_tensors_only(rank):
    import torch_xla

    device = torch_xla.device()
    layer = torch.nn.Linear(3, 2)
    # torch lets only CPU-like tensor types swap data (`has_compatible_shallow_copy_type`): not XLA's
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        layer.weight.data = layer.weight.data.to(device)
    layer = layer.to(device)  # what torch_xla's docs do: new parameter objects on the core
    weight = layer.weight
    weight.data = torch.full((2, 3), 2.0, device=device)  # between XLA tensors: the object stays
    assert layer.weight is weight and weight.device == device and weight.sum().item() == 12
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        weight.data = torch.zeros(2, 3)
    layer(torch.ones(1, 3, device=device)).sum().backward()
    assert weight.grad.device == device
    with pytest.raises(RuntimeError, match="attempting to assign a gradient with device type 'cpu'"):
        weight.grad = torch.zeros(2, 3)
