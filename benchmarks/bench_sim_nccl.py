"""Benchmark of the simulated NCCL group: collectives and a DDP step against plain Gloo on CPU tensors.

In each of `--ranks` simulated GPU ranks, the same work runs twice, alternately, under
the same load: once on simulated CUDA tensors through the "nccl" group (a Python
process group over Gloo, `accel.sim.cuda.nccl.process_group`), once on CPU tensors through a plain
Gloo group of the same ranks. Timed: an all_reduce of `--numel` floats, and a DDP
training step of a small MLP (DDP with device_ids against CPU DDP). Printed: the median
ratio (simulated NCCL / Gloo) over rounds and ranks, with its range.

    python benchmarks/bench_sim_nccl.py [--ranks 2] [--numel 262144] [--rounds 5] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _measure(numel: int, rounds: int, repeat: int) -> dict[str, list[float]]:
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = int(os.environ["RANK"])
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    gloo = dist.new_group(backend="gloo")

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    ddp = {
        "nccl": DistributedDataParallel(model().cuda(), device_ids=[rank]),
        "gloo": DistributedDataParallel(model(), process_group=gloo),
    }
    optim = {kind: torch.optim.SGD(m.parameters(), lr=0.01) for kind, m in ddp.items()}
    data = {"nccl": torch.ones(numel, device="cuda"), "gloo": torch.ones(numel)}
    batch = {"nccl": torch.randn(32, 64).cuda(), "gloo": torch.randn(32, 64)}
    groups = {"nccl": None, "gloo": gloo}

    def all_reduce(kind: str) -> None:
        dist.all_reduce(data[kind], group=groups[kind])

    def step(kind: str) -> None:
        loss = ddp[kind](batch[kind]).square().mean()
        optim[kind].zero_grad()
        loss.backward()
        optim[kind].step()

    ratios: dict[str, list[float]] = {"all_reduce": [], "ddp_step": []}
    for name, work in (("all_reduce", all_reduce), ("ddp_step", step)):
        for kind in ("nccl", "gloo"):  # warm-up
            work(kind)
        for _ in range(rounds):
            seconds = {}
            for kind in ("nccl", "gloo"):
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(repeat):
                    work(kind)
                seconds[kind] = time.perf_counter() - start
            ratios[name].append(seconds["nccl"] / seconds["gloo"])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, default=262144)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from accel.sim import launch

    per_rank = launch(
        _measure, args=(args.numel, args.rounds, args.repeat), world_size=args.ranks, device="cuda", isolated=True
    )
    print(f"simulated NCCL / Gloo on CPU tensors, {args.ranks} ranks, {args.rounds} rounds x {args.repeat} calls:")
    for name in ("all_reduce", "ddp_step"):
        values = [r for ratios in per_rank for r in ratios[name]]
        what = f"all_reduce of {args.numel} floats" if name == "all_reduce" else "DDP step, 64-256-1 MLP, batch 32"
        print(f"  {what:<36} median {statistics.median(values):.2f}x  (range {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
