"""No hidden device in sight: `torch.accelerator` and torch's device look-ups say CUDA on simulated GPUs.

Written the way code for torch >= 2.6 is: the device comes from `torch.accelerator`, the
backend from `get_default_backend_for_device`, the process group is created with
`device_id`. Each test runs on 2 and 4 simulated GPU ranks.
"""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_torch_accelerator_is_cuda(rank, world_size):
    import torch.distributed as dist

    acc = torch.accelerator.current_accelerator()
    assert acc == torch.device("cuda") and torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator(check_available=True).type == "cuda"
    assert torch.accelerator.device_count() == world_size
    torch.accelerator.set_device_index(rank)
    assert torch.accelerator.current_device_index() == rank == torch.cuda.current_device()
    with torch.accelerator.device_index(0):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == rank
    torch.accelerator.synchronize()
    torch.accelerator.current_stream().synchronize()
    assert torch.accelerator.memory_allocated() == torch.cuda.memory_allocated()
    assert torch.accelerator.max_memory_allocated() == torch.cuda.max_memory_allocated()
    assert torch.get_device_module() is torch.cuda and torch.get_device_module(acc) is torch.cuda
    assert dist.get_default_backend_for_device(acc) == "nccl"
    with pytest.raises(ValueError, match="doesn't match the current accelerator cuda"):
        torch.accelerator.set_device_index(torch.device("cpu"))

    device = torch.device(f"{acc}:{rank}")
    x = torch.ones(3, device=device)
    assert x.device == device and x.is_cuda and x.untyped_storage().device == device
    assert x.untyped_storage().is_cuda and x[1:].untyped_storage().device == device
    assert "simcuda" not in repr(x.untyped_storage()) + str(x.untyped_storage().device)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_script_of_today_trains_ddp_on_the_accelerator(rank, world_size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    acc = torch.accelerator.current_accelerator()
    device = torch.device(acc.type, rank)
    torch.accelerator.set_device_index(rank)
    dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device)
    assert dist.get_backend() == "nccl"
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1).to(device), device_ids=[rank])
    assert next(model.parameters()).device == device
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.full((2, 4), float(rank), device=device)).sum()
    loss.backward()
    opt.step()
    grads = [torch.zeros(1, device=device) for _ in range(world_size)]
    dist.all_gather(grads, model.module.bias.grad)
    assert all(torch.equal(g, grads[0]) for g in grads)  # DDP averaged the gradients
    dist.destroy_process_group()


@distributed_test(world_size=SIZES, device="cuda")
def test_ddp_finding_unused_parameters(rank, world_size):
    # DDP copies its map of used parameters through pinned host memory in every backward
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")

    class HalfUsed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = HalfUsed().cuda()
    ddp = DDP(model, device_ids=[rank], find_unused_parameters=True)
    for _ in range(2):
        ddp(torch.full((1, 2), float(rank + 1), device="cuda")).sum().backward()
    assert model.unused.weight.grad is None
    mean = sum(r + 1 for r in range(world_size)) / world_size
    assert model.used.weight.grad.tolist() == [[2 * mean, 2 * mean]]
    dist.destroy_process_group()


@distributed_test(world_size=SIZES, device="cuda")
def test_param_data_moves_between_cpu_and_gpu_as_on_a_gpu(rank):
    gpu = torch.device("cuda", rank)
    torch.cuda.set_device(rank)
    layer = torch.nn.Linear(3, 2)
    weight = layer.weight
    weight.flag = "mine"
    weight.data = weight.data.to(gpu)  # FSDP's and Accelerate's way of moving a parameter
    assert layer.weight is weight and isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert weight.device == gpu and weight.is_cuda and weight.flag == "mine"
    assert layer.weight in list(layer.parameters())

    layer.bias.data = layer.bias.data.to(gpu)
    out = layer(torch.ones(1, 3, device=gpu)).sum()
    out.backward()
    assert weight.grad.device == gpu and weight.grad.tolist() == [[1.0] * 3] * 2
    del out

    same = weight.data.clone() * 2
    weight.data = same  # GPU to GPU: shares the new data
    assert weight.device == gpu and torch.equal(weight.detach(), same)
    same.add_(1)
    assert torch.equal(weight.detach(), same)

    weight.data = weight.data.to(torch.float64)  # a dtype change, as set_data allows
    assert weight.dtype == torch.float64 and weight.device == gpu

    weight.data = weight.data.cpu()  # and back to the host
    assert weight.device.type == "cpu" and type(weight) is torch.nn.Parameter and weight.flag == "mine"

    plain = torch.zeros(2)
    plain.data = torch.ones(2, device=gpu)
    assert plain.device == gpu and plain.tolist() == [1.0, 1.0] and not isinstance(plain, torch.nn.Parameter)

    held = torch.nn.Parameter(torch.zeros(2))
    import weakref

    keep = weakref.ref(held)
    held.data = torch.ones(2, device=gpu)  # a weak reference does not stop it, as on a GPU
    assert keep() is held and held.device == gpu
    pinned = torch.nn.Parameter(torch.zeros(2))
    view = pinned[:1]  # a view holds its C++ tensor: the one move the simulator refuses
    with pytest.raises(RuntimeError, match="cannot move a tensor between cpu and cuda"):
        pinned.data = torch.ones(2, device=gpu)
    assert view.device.type == "cpu"


@distributed_test(world_size=SIZES, device="cuda")
def test_tensors_wrapping_simulated_ones_report_cuda(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    dt = distribute_tensor(torch.arange(4.0 * world_size, device="cuda"), mesh, [Shard(0)])
    assert dt.device == torch.device("cuda", rank) and dt.is_cuda
    assert dt.to_local().tolist() == [4.0 * rank + i for i in range(4)]
    assert "simcuda" not in repr(dt) and mesh.device_type == "cuda"
    assert dist.get_backend(mesh.get_group()) == "nccl"


@distributed_test(world_size=2, device="cuda")
def test_errors_raised_to_python_name_cuda(rank):
    p = torch.zeros(2, device="cuda", requires_grad=True)
    with pytest.raises(
        RuntimeError,
        match="^attempting to assign a gradient with device type 'cpu' to a tensor with device type 'cuda'",
    ):
        p.grad = torch.zeros(2)
    p.grad = torch.ones(2, device="cuda")
    assert p.grad.tolist() == [1.0, 1.0]
    del p.grad
    assert p.grad is None
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as info:
        torch.ones(2, device="cuda") + torch.ones(2)
    assert "simcuda" not in str(info.value)
