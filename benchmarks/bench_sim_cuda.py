"""Benchmark of simulated GPUs: a training step on simulated CUDA against the same step on the CPU.

Each of `--ranks` simulated GPU ranks builds the same MLP twice (`--layers` hidden
layers of `--width`, batch `--batch`, AdamW): one copy on its simulated GPU, one on
plain CPU tensors, torch on one thread. The two are timed (CPU time) alternately, `--steps` steps at a time, for
`--rounds` rounds, so both run side by side under the same load; the ratio of each
pair of blocks is reported (median and range over pairs and ranks). A CPU-rank run of
the same step on a `device="cpu"` pool is timed too, for scale. The fp32 losses of the
two copies are compared: they must be equal.

    python benchmarks/bench_sim_cuda.py [--ranks 2] [--width 256] [--layers 2] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _step_timer(device: str, width: int, layers: int, batch: int):  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    size = width
    for _ in range(layers):
        blocks += [torch.nn.Linear(size, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=generator).to(device)
    y = torch.randn(batch, 1, generator=generator).to(device)
    losses: list[float] = []

    def run(steps: int) -> float:
        # CPU time of this process (torch on one thread): on a loaded machine it measures
        # the work done, which wall time does not
        start = time.process_time()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return time.process_time() - start

    return run, losses


def side_by_side(width: int, layers: int, batch: int, steps: int, rounds: int) -> dict:
    """In a simulated GPU rank: alternate blocks of steps on cuda and on cpu."""
    cuda_run, cuda_losses = _step_timer("cuda", width, layers, batch)
    cpu_run, cpu_losses = _step_timer("cpu", width, layers, batch)
    cuda_run(3), cpu_run(3)  # warm-up
    pairs = []
    for _ in range(rounds):
        cuda_time, cpu_time = cuda_run(steps), cpu_run(steps)
        pairs.append((cuda_time / steps, cpu_time / steps))
    return {"pairs": pairs, "equal_losses": cuda_losses == cpu_losses}


def cpu_ranks(width: int, layers: int, batch: int, steps: int, rounds: int) -> float:
    """In a plain CPU rank: the same step, for scale."""
    run, _ = _step_timer("cpu", width, layers, batch)
    run(3)
    return min(run(steps) for _ in range(rounds)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from accel.sim import launch

    shape = (args.width, args.layers, args.batch, args.steps, args.rounds)
    results = launch(side_by_side, args=shape, world_size=args.ranks, device="cuda", timeout=600)
    plain = launch(cpu_ranks, args=shape, world_size=args.ranks, device="cpu", timeout=600)
    ratios = [cuda / cpu for result in results for cuda, cpu in result["pairs"]]
    cuda_ms = statistics.median(cuda for result in results for cuda, _ in result["pairs"]) * 1e3
    cpu_ms = statistics.median(cpu for result in results for _, cpu in result["pairs"]) * 1e3
    print(
        f"MLP {args.layers}x{args.width}, batch {args.batch}, AdamW; {args.ranks} simulated GPU ranks, "
        f"{args.rounds} rounds of {args.steps} steps, interleaved"
    )
    print(f"  step on simulated cuda : {cuda_ms:.3f} ms (median)")
    print(f"  step on cpu (same rank): {cpu_ms:.3f} ms (median)")
    print(f"  step on plain cpu ranks: {statistics.median(plain) * 1e3:.3f} ms (best block, for scale)")
    print(
        f"  ratio simulated cuda / cpu: {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs; target <= 2x)"
    )
    print(f"  fp32 losses equal on cuda and cpu: {all(result['equal_losses'] for result in results)}")


if __name__ == "__main__":
    main()
