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

import _side_by_side as sbs


def _step_timer(device: str, width: int, layers: int, batch: int):  # type: ignore[no-untyped-def]
    model, optimizer, x, y = sbs.mlp(device, width, layers, batch)
    return sbs.step_timer(model, optimizer, x, y, optimizer.step)


def side_by_side(width: int, layers: int, batch: int, steps: int, rounds: int) -> dict:
    """In a simulated GPU rank: alternate blocks of steps on cuda and on cpu."""
    cuda_run, cuda_losses = _step_timer("cuda", width, layers, batch)
    cpu_run, cpu_losses = _step_timer("cpu", width, layers, batch)
    pairs = sbs.interleave(cuda_run, cpu_run, steps, rounds)
    return {"pairs": pairs, "equal_losses": cuda_losses == cpu_losses}


def cpu_ranks(width: int, layers: int, batch: int, steps: int, rounds: int) -> float:
    """In a plain CPU rank: the same step, for scale."""
    run, _ = _step_timer("cpu", width, layers, batch)
    run(3)
    return min(run(steps) for _ in range(rounds)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.add_arguments(parser)
    args = parser.parse_args()
    from accel.sim import launch

    shape = sbs.shape(args)
    results = launch(side_by_side, args=shape, world_size=args.ranks, device="cuda", timeout=600)
    plain = launch(cpu_ranks, args=shape, world_size=args.ranks, device="cpu", timeout=600)
    scale = f"  step on plain cpu ranks: {statistics.median(plain) * 1e3:.3f} ms (best block, for scale)"
    labels = ("step on simulated cuda ", "step on cpu (same rank)")
    sbs.report(args, results, "cuda", "simulated GPU ranks", labels, extra=[scale])


if __name__ == "__main__":
    main()
