"""A plain torch.distributed training script, written for `torchrun` on GPUs (no accel in it).

    torchrun --nproc_per_node 2 examples/plain_ddp.py                    # real GPUs
    accel launch --simulate cuda --num_processes 2 examples/plain_ddp.py  # simulated GPUs, unchanged
    accel launch --simulate cpu --num_processes 2 examples/plain_ddp.py --backend gloo

It reads torchrun's environment, creates its own process group, pins its GPU, trains a
small regression with DDP(device_ids=[local_rank]), all-reduces a metric tensor built on
the GPU, and prints one line per rank. `--backend` picks the group: "nccl" (default on
GPUs), "gloo", "default" (`init_process_group()`) or "env" (`init_method="env://"`).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo", "default", "env"], default=None)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available()
    backend = args.backend or ("nccl" if on_gpu else "gloo")
    if backend == "default":
        dist.init_process_group()
    elif backend == "env":
        dist.init_process_group(init_method="env://")
    else:
        dist.init_process_group(backend)
    if on_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if on_gpu else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    true_weights = torch.linspace(-1.0, 1.0, 8)
    for _ in range(args.steps):
        x = torch.randn(16, 8, generator=generator)
        y = (x @ true_weights).unsqueeze(1)
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    # A metric built on the GPU and summed over ranks, as evaluation code does.
    metric = torch.tensor([loss.item(), 1.0], device=device)
    dist.all_reduce(metric)
    mean_loss = (metric[0] / metric[1]).item()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(
        f"rank {rank}/{world_size} backend={dist.get_backend()} device={metric.device} "
        f"mean_loss={mean_loss:.6f} checksum={checksum:.6f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
