"""Benchmark of GPU memory counting: a DDP training step on simulated GPUs with the counters on and off.

Each of `--ranks` simulated GPU ranks trains the same MLP (`--layers` hidden layers of
`--width`, batch `--batch`, AdamW) wrapped in DDP over the simulated NCCL group, as a
user's script does. Blocks of `--steps` steps alternate between memory counting on (the
default: every storage counted as the CUDA caching allocator counts it) and off
(``ACCEL_SIM_GPU_MEMORY=0``), `--rounds` times, so both run under the same load; the
ratio of each pair is reported (median and range over pairs and ranks), with the peak
memory the counted steps reached. With `--history`, the pairs are counted steps with PyTorch's
memory tracker recording (`torch.cuda.memory._record_memory_history(max_entries=100000)`, as
torchtitan's memory snapshots turn it on) against counted steps without it.

    python benchmarks/bench_sim_memory.py [--ranks 2] [--width 512] [--layers 4] [--batch 64] [--history]
"""

from __future__ import annotations

import argparse
import statistics
import time


def side_by_side(width: int, layers: int, batch: int, steps: int, rounds: int, history: bool = False) -> dict:
    """In a simulated GPU rank: alternate blocks of DDP steps with memory counting on and off (`history`: counted
    steps with the memory tracker recording, and without)."""
    import os

    import torch
    import torch.distributed as dist

    from accel.sim.cuda.memory import allocator as cuda_memory
    from accel.sim.cuda.torch_cuda import properties as cuda_properties

    torch.set_num_threads(1)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1)).cuda(), device_ids=[local_rank]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device="cuda")
    y = torch.randn(batch, 1, device="cuda")
    card = cuda_properties.model()

    def run(first: bool) -> float:
        if history:
            cuda_memory.install(card, torch.cuda.device_count())
            torch.cuda.memory._record_memory_history(enabled="all" if first else None, max_entries=100000)
        elif first:
            cuda_memory.install(card, torch.cuda.device_count())
        else:
            cuda_memory.uninstall()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        return (time.perf_counter() - start) / steps

    run(True), run(False)  # warm-up
    pairs = [(run(True), run(False)) for _ in range(rounds)]
    run(True)
    peak = torch.cuda.max_memory_allocated()
    dist.destroy_process_group()
    return {"pairs": pairs, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--history", action="store_true", help="memory tracker recording on/off (counted both)")
    args = parser.parse_args()
    from accel.sim import launch

    results = launch(
        side_by_side,
        args=(args.width, args.layers, args.batch, args.steps, args.rounds, args.history),
        world_size=args.ranks,
        device="cuda",
        timeout=600,
        isolated=True,
    )
    ratios = [on / off for result in results for on, off in result["pairs"]]
    steps_on = statistics.median(on for result in results for on, _ in result["pairs"])
    steps_off = statistics.median(off for result in results for _, off in result["pairs"])
    first, second = ("recorded", "not recorded") if args.history else ("counted", "not counted")
    print(
        f"DDP step on {args.ranks} simulated GPUs (MLP {args.layers}x{args.width}, batch {args.batch}): "
        f"{first} {steps_on * 1e3:.2f} ms, {second} {steps_off * 1e3:.2f} ms"
    )
    what = "memory tracker recording" if args.history else "memory counting"
    print(
        f"{what} on/off: median {statistics.median(ratios):.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs); "
        f"peak allocated {results[0]['peak'] / 2**20:.1f} MiB per rank"
    )


if __name__ == "__main__":
    main()
