"""Training on simulated GPUs: accel on CUDA tensors, a script written for real GPUs, and equal losses to CPU ranks."""

import pytest
import torch

from accel.sim import launch
from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_accel_works_on_simulated_cuda_tensors(rank, world_size, tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Accelerator
    from accel.state import PartialState

    accelerator = Accelerator()
    here = torch.device("cuda", rank)
    assert accelerator.device == PartialState().device == here

    x = torch.full((2, 3), float(rank), device="cuda")
    gathered = accelerator.gather(x)
    assert gathered.device == here and gathered[::2, 0].tolist() == [float(r) for r in range(world_size)]
    padded = accelerator.pad_across_processes(torch.ones(rank + 1, device="cuda"), dim=0)
    assert padded.device == here and padded.shape == (world_size,)
    total = accelerator.reduce(torch.tensor([rank + 1.0], device="cuda"), reduction="sum")
    assert total.device == here and total.item() == world_size * (world_size + 1) / 2
    from accel.utils import broadcast

    assert broadcast(torch.tensor([rank], device="cuda"), from_process=world_size - 1).item() == world_size - 1

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))  # 10 samples: uneven over the ranks
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=2))
    assert accelerator.unwrap_model(model).weight.device == here and model.device_ids == [rank]
    seen = []
    for inputs, targets in loader:
        assert inputs.device == targets.device == here
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(accelerator.gather_for_metrics(targets))
    assert torch.cat(seen).shape == (10, 1) and torch.cat(seen).device == here

    accelerator.save_state(tmp_path / "state")
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.zero_()
    accelerator.load_state(tmp_path / "state")
    restored = accelerator.unwrap_model(model).weight
    assert restored.device == here and torch.equal(restored.detach().cpu(), weights.cpu())
    assert all(s.device == here for state in optimizer.state.values() for k, s in state.items() if k != "step")


def gpu_script(local_rank, checkpoint):
    """A training script as written for real GPUs (torchrun + NCCL), unchanged but for the group's name."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    generator = torch.Generator().manual_seed(local_rank)
    correct = torch.zeros((), device="cuda")
    for _ in range(4):
        batch = torch.randn(16, 8, generator=generator).cuda(non_blocking=True)
        labels = torch.randint(0, 4, (16,), generator=generator).to("cuda")
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(batch)
            loss = torch.nn.functional.cross_entropy(logits, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        correct += (logits.argmax(dim=1) == labels).sum()
    metrics = torch.tensor([correct.item(), 64.0], device="cuda")
    dist.all_reduce(metrics)
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "scaler": scaler.state_dict()}, checkpoint)
    dist.barrier()
    state = torch.load(checkpoint, map_location={"cuda:0": f"cuda:{local_rank}"})
    model.module.load_state_dict(state["model"])
    return {
        "loss_dtype": str(loss.dtype),
        "logits_dtype": str(logits.dtype),
        "metrics": metrics.tolist(),
        "weight_device": str(model.module[0].weight.device),
        "loaded_device": str(state["model"]["0.weight"].device),
        "weights": model.module[2].weight.detach().cpu().tolist(),
    }


@distributed_test(world_size=SIZES, device="cuda")
def test_a_script_written_for_real_gpus_runs_unchanged(rank, world_size, tmp_path):
    import torch.distributed as dist

    result = gpu_script(rank, tmp_path / "checkpoint.pt")
    assert result["logits_dtype"] == "torch.float16" and result["loss_dtype"] == "torch.float32"
    assert result["weight_device"] == result["loaded_device"] == f"cuda:{rank}"
    assert result["metrics"][1] == 64.0 * world_size and 0 <= result["metrics"][0] <= 64.0 * world_size
    everyone = [None] * world_size
    dist.all_gather_object(everyone, result["weights"])
    assert all(w == everyone[0] for w in everyone)  # DDP kept the replicas equal


def fp32_training(steps=6):
    """The same accel training on any device; returns the loss of every step on this rank."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Accelerator
    from accel.utils import set_seed

    set_seed(0)
    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return str(accelerator.device), losses


@pytest.mark.parametrize("world_size", SIZES)
def test_fp32_training_gives_equal_losses_on_simulated_gpus_and_cpu_ranks(world_size):
    on_cpu = launch(fp32_training, world_size=world_size, device="cpu")
    on_gpus = launch(fp32_training, world_size=world_size, device="cuda")
    for rank in range(world_size):
        assert on_cpu[rank][0] == "cpu" and on_gpus[rank][0] == f"cuda:{rank}"
        assert on_gpus[rank][1] == on_cpu[rank][1]  # bitwise: the same float32 arithmetic
