"""The "nccl" process group of simulated GPUs: NCCL's collectives and NCCL's refusals, over Gloo.

Each test runs on 2 and 4 simulated GPU ranks and creates its own group with
`init_process_group("nccl")`, as a script written for torchrun does.
"""

import pytest
import torch
from support import nccl_group as _nccl_group

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_nccl_collectives_on_simulated_gpus(rank, world_size):
    import torch.distributed as dist

    here = _nccl_group(rank)
    assert dist.get_backend() == "nccl" and dist.is_nccl_available()
    ranks = list(range(world_size))

    t = torch.full((3,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    assert t.device == here and t.tolist() == [sum(r + 1 for r in ranks)] * 3

    b = torch.full((2,), float(rank), device="cuda")
    dist.broadcast(b, src=world_size - 1)
    assert b.device == here and b.tolist() == [world_size - 1.0] * 2

    parts = [torch.empty(2, device="cuda") for _ in ranks]
    dist.all_gather(parts, torch.full((2,), float(rank), device="cuda"))
    assert [p.tolist() for p in parts] == [[float(r)] * 2 for r in ranks] and parts[1].device == here

    flat = torch.empty(2 * world_size, device="cuda")
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device="cuda"))
    assert flat.device == here and flat.tolist() == [float(r) for r in ranks for _ in range(2)]

    mine = torch.empty(1, device="cuda")
    dist.reduce_scatter_tensor(mine, torch.arange(world_size, dtype=torch.float32, device="cuda"))
    assert mine.device == here and mine.item() == rank * world_size

    swapped = torch.empty(world_size, device="cuda")
    dist.all_to_all_single(swapped, torch.arange(world_size, dtype=torch.float32, device="cuda") + 10 * rank)
    assert swapped.tolist() == [10.0 * r + rank for r in ranks]

    # a ring of send/recv (even ranks send first, so the ring cannot lock)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    out, got = torch.full((2,), float(rank), device="cuda"), torch.empty(2, device="cuda")
    if rank % 2 == 0:
        dist.send(out, right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(out, right)
    assert got.device == here and got.tolist() == [float(left)] * 2

    dist.barrier()

    # object collectives go through the current GPU, as on NCCL
    objects = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in ranks]
    listed = [f"from {rank}"]
    dist.broadcast_object_list(listed, src=1)
    assert listed == ["from 1"]
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(rank * 2, gathered, dst=0)
    if rank == 0:
        assert gathered == [r * 2 for r in ranks]


@distributed_test(world_size=SIZES, device="cuda")
def test_nccl_refuses_cpu_tensors_with_its_own_words(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    # the tensor a collective runs on is a CPU tensor: torch finds no backend for the CPU
    with pytest.raises(RuntimeError, match="^No backend type associated with device type cpu$"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.broadcast(torch.ones(2), src=0)
    # a CPU tensor among CUDA ones reaches the NCCL backend, which refuses it
    with pytest.raises(ValueError, match="^Tensors must be CUDA and dense$"):
        dist.all_gather([torch.empty(2) for _ in range(world_size)], torch.ones(2, device="cuda"))
    with pytest.raises(ValueError, match="^Tensors must be CUDA and dense$"):
        dist.all_gather_into_tensor(torch.empty(2 * world_size), torch.ones(2, device="cuda"))
    # the refusals happen before any communication: the group still works
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    assert t.item() == world_size


@distributed_test(world_size=SIZES, device="cuda")
def test_two_ranks_on_one_gpu_fail_as_nccl_does(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)  # every rank on GPU 0: a forgotten set_device(local_rank) on a real node
    with pytest.raises(dist.DistBackendError) as failure:
        dist.all_reduce(torch.ones(1, device="cuda"))
    message = str(failure.value)
    assert "ncclInvalidUsage" in message
    other = 1 if rank == 0 else 0
    assert f"Duplicate GPU detected : rank {max(rank, other)} and rank {min(rank, other)} both on CUDA device 0" in (
        message
    )
    assert "torch.cuda.set_device(local_rank)" in message


@distributed_test(world_size=SIZES, device="cuda")
def test_object_collectives_bind_the_current_gpu(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    # torch puts the pickled objects on the current GPU: GPU 0 on every rank (a barrier guesses the rank's GPU,
    # test_sim_nccl_semantics.py)
    with pytest.raises(dist.DistBackendError, match="Duplicate GPU detected"):
        dist.broadcast_object_list([rank], src=0)


@distributed_test(world_size=SIZES, device="cuda")
def test_nccl_subgroups(rank, world_size):
    import torch.distributed as dist

    here = _nccl_group(rank)
    evens = dist.new_group(ranks=list(range(0, world_size, 2)), backend="nccl")
    same = dist.new_group()  # the default group's backend
    assert dist.get_backend(same) == "nccl"
    t = torch.ones(1, device=here)
    dist.all_reduce(t, group=same)
    assert t.item() == world_size
    if rank % 2 == 0:
        assert dist.get_backend(evens) == "nccl"
        e = torch.ones(1, device=here)
        dist.all_reduce(e, group=evens)
        assert e.item() == len(range(0, world_size, 2))
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1), group=evens)


def _train(ddp, rank, device, steps=3):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, grads = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        grads.append([p.grad.detach().cpu().clone() for p in ddp.parameters()])
        optimizer.step()
        losses.append(loss.item())
    return losses, grads, [p.detach().cpu().clone() for p in ddp.parameters()]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@distributed_test(world_size=SIZES, device="cuda")
def test_ddp_with_device_ids_is_bitwise_cpu_ddp_on_gloo(rank, world_size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    here = _nccl_group(rank)
    gloo = dist.new_group(backend="gloo")
    on_gpu = DistributedDataParallel(_model().cuda(), device_ids=[rank])
    on_cpu = DistributedDataParallel(_model(), process_group=gloo)
    assert all(p.device == here for p in on_gpu.parameters())

    gpu_losses, gpu_grads, gpu_params = _train(on_gpu, rank, "cuda")
    cpu_losses, cpu_grads, cpu_params = _train(on_cpu, rank, "cpu")

    assert gpu_losses == cpu_losses
    for step_gpu, step_cpu in zip(gpu_grads, cpu_grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_gpu, step_cpu, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(gpu_params, cpu_params, strict=True))
    # DDP synchronised the gradients: every rank holds the same parameters
    checksums = [None] * world_size
    dist.all_gather_object(checksums, [p.sum().item() for p in gpu_params])
    assert all(c == checksums[0] for c in checksums)


@distributed_test(world_size=2, device="cuda")
def test_a_communicator_stays_on_its_gpu(rank):
    import torch.distributed as dist

    here = _nccl_group(rank)
    dist.all_reduce(torch.ones(1, device=here))
    elsewhere = torch.device("cuda", 1 - rank)
    with pytest.raises(RuntimeError, match=rf"communicator is on cuda:{rank}.*on cuda:{1 - rank}"):
        dist.all_reduce(torch.ones(1, device=elsewhere))


@distributed_test(world_size=2, device="cuda")
def test_mixed_cpu_and_nccl_groups_by_device_backend_strings(rank):
    import torch.distributed as dist

    here = _nccl_group(rank)
    both = dist.new_group(backend="cpu:gloo,cuda:nccl")  # CPU tensors over Gloo, CUDA ones NCCL's way
    strict = dist.new_group(backend="cuda:nccl")
    for t in (torch.ones(1), torch.ones(1, device=here)):
        dist.all_reduce(t, group=both)
        assert t.item() == 2
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1), group=strict)


@distributed_test(world_size=2, device="cuda")
def test_device_id_sets_up_the_communicator_at_init(rank):
    import torch.distributed as dist

    with pytest.raises(dist.DistBackendError, match="Duplicate GPU detected"):
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))


@distributed_test(world_size=4, device="cuda")
def test_send_recv_between_two_ranks_involves_only_them(rank):
    import torch.distributed as dist

    here = _nccl_group(rank)
    if rank in (0, 1):  # ranks 2 and 3 never touch the group: a pair communicator, as NCCL's
        t = torch.full((2,), 5.0, device=here) if rank == 0 else torch.zeros(2, device=here)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        assert t.tolist() == [5.0, 5.0]


@distributed_test(world_size=2, device="cuda")
def test_send_recv_on_one_gpu_fail_as_nccl_does(rank):
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    t = torch.ones(1, device="cuda")
    with pytest.raises(dist.DistBackendError, match="Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0"):
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)


@distributed_test(world_size=SIZES, device="cuda")
def test_accel_barrier_names_this_ranks_gpu(rank):
    import warnings

    import torch.distributed as dist

    from accel.state import PartialState

    state = PartialState()
    assert dist.get_backend() == "nccl" and state.device == torch.device("cuda", rank)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a NCCL barrier has to guess its GPU
        state.wait_for_everyone()
    assert dist.group.WORLD.gpu == rank  # the communicator was set up on this rank's GPU
