"""Benchmark of `torch.compile` on simulated GPUs: a compiled training step against the eager one.

Each of `--ranks` simulated GPU ranks builds the same 4-layer transformer encoder twice
(`nn.TransformerEncoder`, d_model `--dim`, `--heads` heads, sequence `--seq`, batch
`--batch`, AdamW), each wrapped in DDP as users write it; one copy is `torch.compile`d.
It reports:

* the first compiled step's cost over an eager step (Dynamo's tracing, paid once per
  process and shape), in seconds;
* the ratio compiled step / eager step, from blocks of `--steps` steps timed alternately
  (CPU time) for `--rounds` rounds, so that both run under the same load;
* whether the two copies' fp32 losses are equal (the compiled graphs run the same ops).

    python benchmarks/bench_compile.py [--ranks 2] [--dim 128] [--seq 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _copy(dim: int, heads: int, layers: int, rank: int):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
    model = DDP(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).cuda(), device_ids=[rank])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _runner(model, optimizer, x, losses):  # type: ignore[no-untyped-def]
    def run(steps: int) -> float:
        start = time.process_time()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return time.process_time() - start

    return run


def side_by_side(dim: int, heads: int, seq: int, batch: int, steps: int, rounds: int) -> dict:
    """In a simulated GPU rank: the first compiled step's cost, then alternate blocks of eager and compiled steps."""
    import os

    import torch

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(1 + rank)).cuda()
    eager_losses: list[float] = []
    compiled_losses: list[float] = []
    eager = _runner(*_copy(dim, heads, 4, rank), x, eager_losses)
    model, optimizer = _copy(dim, heads, 4, rank)
    compiled = _runner(torch.compile(model), optimizer, x, compiled_losses)
    eager_step = eager(1)
    start = time.perf_counter()
    compiled(1)
    first_call = time.perf_counter() - start
    eager(2), compiled(2)  # warm-up
    pairs = []
    for _ in range(rounds):
        compiled_time, eager_time = compiled(steps), eager(steps)
        pairs.append((compiled_time / steps, eager_time / steps))
    return {"first": first_call, "eager_step": eager_step, "pairs": pairs, "equal": eager_losses == compiled_losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from accel.sim import launch

    shape = (args.dim, args.heads, args.seq, args.batch, args.steps, args.rounds)
    results = launch(side_by_side, args=shape, world_size=args.ranks, device="cuda", timeout=1200)
    pairs = [pair for result in results for pair in result["pairs"]]
    ratios = [compiled / eager for compiled, eager in pairs]
    print(
        f"4-layer transformer encoder, d_model {args.dim}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
        f"AdamW, DDP; {args.ranks} simulated GPU ranks, {args.rounds} rounds of {args.steps} steps, interleaved"
    )
    print(f"  eager step:    {statistics.median(e for _, e in pairs) * 1e3:.1f} ms (median, CPU time)")
    print(f"  compiled step: {statistics.median(c for c, _ in pairs) * 1e3:.1f} ms (median, CPU time)")
    print(
        f"  ratio compiled / eager: {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs)"
    )
    firsts = [result["first"] for result in results]
    print(
        f"  first compiled step (Dynamo traces): {statistics.median(firsts):.2f} s wall "
        f"(ranks: {', '.join(f'{f:.2f}' for f in firsts)}), "
        f"{statistics.median(r['first'] / r['eager_step'] for r in results):.0f}x an eager step"
    )
    print(f"  fp32 losses of the compiled and eager copies equal: {all(r['equal'] for r in results)}")


if __name__ == "__main__":
    main()
