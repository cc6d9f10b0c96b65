"""What bench_sim_cuda.py and bench_sim_xla.py share: a training step on a simulated device
against the same step on the CPU, in the same rank.

`mlp` builds the seeded MLP, AdamW and batch both benchmarks time; `step_timer` times blocks
of its steps in CPU time; `interleave` alternates blocks on the two copies; `add_arguments`
and `report` are the common command line and printout (ratios, medians, equal losses).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def mlp(device: Any, width: int, layers: int, batch: int) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, x, y): the same MLP (`layers` hidden layers of `width`), AdamW and batch
    on `device` in every call; torch on one thread."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=generator).to(device)
    y = torch.randn(batch, 1, generator=generator).to(device)
    return model, optimizer, x, y


def step_timer(
    model: Any, optimizer: Any, x: Any, y: Any, finish: Callable[[], None]
) -> tuple[Callable[[int], float], list[float]]:
    """(run, losses): run(steps) does `steps` steps (forward, backward, `finish()`: the
    optimizer's step and what goes with it) and returns their CPU time; losses fills up."""
    import torch

    losses: list[float] = []

    def run(steps: int) -> float:
        # CPU time of this process (torch on one thread): on a loaded machine it measures
        # the work done, which wall time does not
        start = time.process_time()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            finish()
            losses.append(loss.item())
        return time.process_time() - start

    return run, losses


def interleave(
    sim_run: Callable[[int], float], cpu_run: Callable[[int], float], steps: int, rounds: int
) -> list[tuple[float, float]]:
    """(simulated, cpu) seconds per step of each round, after a warm-up: blocks of `steps`
    alternately, so that both run under the same load."""
    sim_run(3), cpu_run(3)  # warm-up
    pairs = []
    for _ in range(rounds):
        sim_time, cpu_time = sim_run(steps), cpu_run(steps)
        pairs.append((sim_time / steps, cpu_time / steps))
    return pairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and length of the side-by-side run."""
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)


def shape(args: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """The arguments of the in-rank functions: (width, layers, batch, steps, rounds)."""
    return (args.width, args.layers, args.batch, args.steps, args.rounds)


def report(
    args: argparse.Namespace,
    results: Sequence[dict],
    device: str,
    ranks: str,
    labels: tuple[str, str],
    extra: Sequence[str] = (),
) -> None:
    """Print the medians of the ranks' `results` ({"pairs": interleave's, "equal_losses": bool}),
    the ratio simulated / cpu and whether the losses were equal; `labels` name the two steps,
    `extra` lines come before the ratio."""
    pairs = [pair for result in results for pair in result["pairs"]]
    ratios = [sim / cpu for sim, cpu in pairs]
    sim_ms = statistics.median(sim for sim, _ in pairs) * 1e3
    cpu_ms = statistics.median(cpu for _, cpu in pairs) * 1e3
    print(
        f"MLP {args.layers}x{args.width}, batch {args.batch}, AdamW; {args.ranks} {ranks}, "
        f"{args.rounds} rounds of {args.steps} steps, interleaved"
    )
    print(f"  {labels[0]}: {sim_ms:.3f} ms (median)")
    print(f"  {labels[1]}: {cpu_ms:.3f} ms (median)")
    for line in extra:
        print(line)
    print(
        f"  ratio simulated {device} / cpu: {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs; target <= 2x)"
    )
    print(f"  fp32 losses equal on {device} and cpu: {all(result['equal_losses'] for result in results)}")
