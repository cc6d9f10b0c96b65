"""The older DDP tutorials' script: one process per GPU with `mp.spawn(worker, nprocs=torch.cuda.device_count())`.

Run with plain `python` on a simulated node (tests/test_sim_node.py). Each worker takes GPU
`rank`, makes its "nccl" group (env://), trains a small model with DDP on its half of every
batch and writes `RESULT {json}`: its device, losses and trained weights. `reference()`
trains the same model on the CPU in one process on the whole batches: DDP averages the
halves' gradients, which is the whole batch's gradient, so the weights must agree.
"""

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 5
BATCH = 8  # per step, split between the ranks


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 4, generator=generator)
        data.append((x, x.sum(dim=1, keepdim=True) * 0.5))
    return data


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).tolist()


def reference() -> dict:
    """The CPU, one process, whole batches: the losses (of the whole batch) and the trained weights."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": flat(model)}


def worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    model = make_model().cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    share = BATCH // world
    for x, y in batches():
        x, y = x[rank * share : (rank + 1) * share].cuda(), y[rank * share : (rank + 1) * share].cuda()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    result = {
        "rank": rank,
        "world": world,
        "backend": dist.get_backend(),
        "device": str(next(model.parameters()).device),
        "current_device": torch.cuda.current_device(),
        "allocated": torch.cuda.memory_allocated(),
        "losses": losses,
        "weights": flat(model),
    }
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the workers share the pipe
    dist.destroy_process_group()


if __name__ == "__main__":
    count = torch.cuda.device_count()
    print("DEVICES", count, torch.cuda.is_available(), flush=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    mp.spawn(worker, args=(count, free_port), nprocs=count)
