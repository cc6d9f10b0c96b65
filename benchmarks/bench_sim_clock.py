"""Benchmark of the simulated clock: a DDP training step of a small transformer on simulated GPUs with the
clock on and off, with values and shapes only.

Each of `--ranks` simulated GPU ranks trains the same transformer encoder (`--layers` layers of
`--width`, batch `--batch` x `--seq` tokens, AdamW) wrapped in DDP over the simulated NCCL group, as a
user's script does. Blocks of `--steps` steps alternate between the clock on (the default in every
simulated GPU rank: each kernel and collective timed) and off, `--rounds` times, so both run under the
same load; the ratio of each pair is reported (median and range over pairs and ranks), first with
values, then with `shapes_only=True` (the mode plans run in), and the predicted step it gave.

    python benchmarks/bench_sim_clock.py [--ranks 2] [--width 256] [--layers 2] [--batch 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import time


def side_by_side(width: int, layers: int, batch: int, seq: int, steps: int, rounds: int) -> dict:
    """In a simulated GPU rank: alternate blocks of DDP steps with the clock on and off."""
    import os

    import torch
    import torch.distributed as dist

    from accel.sim.cuda.timing import clock

    torch.set_num_threads(1)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.TransformerEncoder(layer, num_layers=layers).cuda(), device_ids=[local_rank]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, seq, width, device="cuda")
    card = clock.current().card  # type: ignore[union-attr]  # the clock runs in a simulated GPU rank
    predicted: list[float] = []

    def run(on: bool) -> float:
        if on:
            clock.start(card)
        else:
            clock.stop()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        elapsed = (time.perf_counter() - start) / steps
        if on:
            predicted.append(statistics.median(s.time_s for s in clock.current().steps))  # type: ignore[union-attr]
        return elapsed

    run(True), run(False)  # warm-up
    pairs = [(run(True), run(False)) for _ in range(rounds)]
    dist.destroy_process_group()
    return {"pairs": pairs, "predicted": statistics.median(predicted)}


def _report(what: str, results: list[dict]) -> None:
    ratios = [on / off for result in results for on, off in result["pairs"]]
    on = statistics.median(a for result in results for a, _ in result["pairs"])
    off = statistics.median(b for result in results for _, b in result["pairs"])
    print(
        f"{what}: clock on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms per step here; on/off median "
        f"{statistics.median(ratios):.3f}x (range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs); "
        f"predicted step on the card {results[0]['predicted'] * 1e3:.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from accel.sim import launch

    shape = (args.width, args.layers, args.batch, args.seq, args.steps, args.rounds)
    print(
        f"DDP step of a {args.layers}-layer transformer encoder (width {args.width}, batch {args.batch} x "
        f"{args.seq}) on {args.ranks} simulated H100s"
    )
    for what, shapes_only in (("with values", False), ("shapes only", True)):
        results = launch(
            side_by_side, args=shape, world_size=args.ranks, device="cuda", timeout=900, shapes_only=shapes_only
        )
        _report(what, results)


if __name__ == "__main__":
    main()
