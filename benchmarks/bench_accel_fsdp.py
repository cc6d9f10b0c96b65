"""Benchmark: an FSDP2 training step through `Accelerator` against the same step with raw `fully_shard`.

The transformer of `bench_sim_fsdp.py` (token embedding, `--layers` pre-norm blocks, width
`--dim`; batch `--batch` x `--seq` tokens, AdamW, fp32) is trained two ways in the same
`--ranks` simulated GPU ranks:

* raw: `fully_shard` on each block, on the final norm (kept gathered after forward, as
  Accelerate 1.15 shards it) and at the root; `loss.backward()`, `optimizer.step()`,
  `optimizer.zero_grad()`;
* accel: `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
  auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]))`,
  `prepare(model, optimizer)` (the same sharding), and a step written as Accelerate's users
  write it: `with accelerator.accumulate(model)`, `accelerator.backward(loss)`, the prepared
  optimizer's `step` and `zero_grad`.

Blocks of `--steps` steps of each alternate inside every round (the order flips every round),
after `--warmup` untimed steps, so that both share the machine's load. Each step is timed in
CPU time of the rank (on a loaded machine it measures the work done, which wall time does
not); wall time is shown too. Medians are over steps, ranks and rounds. The fp32 losses of the
two are compared (same model, data and sharding: they must be equal).

    python benchmarks/bench_accel_fsdp.py [--ranks 2] [--dim 256] [--layers 4] [--batch 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE_KEYS = ("dim", "layers", "heads", "vocab", "batch", "seq")


def _trainers(shape: dict, warmup: int):  # type: ignore[no-untyped-def]
    """{"raw": run, "accel": run} (run(steps) -> [(cpu s, wall s)]) and their losses, in this simulated GPU rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from bench_sim_fsdp import _model
    from torch.distributed.fsdp import fully_shard

    from accel import Accelerator
    from accel.utils import FullyShardedDataParallelPlugin

    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=generator).cuda()
    inputs, targets = tokens[:, :-1], tokens[:, 1:].flatten()
    build = (shape["dim"], shape["layers"], shape["heads"], shape["vocab"])

    torch.manual_seed(0)
    raw_model = _model(*build).cuda()
    for layer in raw_model.layers:
        fully_shard(layer)
    # the final norm on its own, kept gathered after forward: the sharding Accelerate 1.15 (and accel) applies
    fully_shard([raw_model.norm], reshard_after_forward=False)
    fully_shard(raw_model)
    raw_optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = _model(*build)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    losses: dict[str, list[float]] = {"raw": [], "accel": []}

    def raw(steps: int) -> list[tuple[float, float]]:
        times = []
        for _ in range(steps):
            cpu, wall = time.process_time(), time.perf_counter()
            loss = F.cross_entropy(raw_model(inputs), targets)
            loss.backward()
            raw_optimizer.step()
            raw_optimizer.zero_grad()
            losses["raw"].append(loss.item())
            times.append((time.process_time() - cpu, time.perf_counter() - wall))
        return times

    def through_accelerator(steps: int) -> list[tuple[float, float]]:
        times = []
        for _ in range(steps):
            cpu, wall = time.process_time(), time.perf_counter()
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses["accel"].append(loss.item())
            times.append((time.process_time() - cpu, time.perf_counter() - wall))
        return times

    raw(warmup)
    through_accelerator(warmup)
    return {"raw": raw, "accel": through_accelerator}, losses


def in_rank(shape: dict, steps: int, warmup: int, rounds: int) -> dict:
    """In a simulated GPU rank: `rounds` rounds of a block of raw steps and a block of Accelerator steps."""
    import torch

    torch.set_num_threads(1)
    runs, losses = _trainers(shape, warmup)
    times: dict[str, list[tuple[float, float]]] = {"raw": [], "accel": []}
    for round_index in range(rounds):
        order = ("accel", "raw") if round_index % 2 else ("raw", "accel")
        for kind in order:
            times[kind] += runs[kind](steps)
    return {"times": times, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from accel.sim import launch

    shape = {key: getattr(args, key) for key in SHAPE_KEYS}
    task = (shape, args.steps, args.warmup, args.rounds)
    results = launch(in_rank, args=task, world_size=args.ranks, device="cuda", timeout=1800)
    times = {kind: [t for r in results for t in r["times"][kind]] for kind in ("raw", "accel")}
    cpu_ms = {kind: statistics.median(cpu for cpu, _ in steps) * 1e3 for kind, steps in times.items()}
    wall_ms = {kind: statistics.median(wall for _, wall in steps) * 1e3 for kind, steps in times.items()}
    print(
        f"Transformer: {args.layers} layers, d_model {args.dim}, {args.heads} heads, vocab {args.vocab}; "
        f"batch {args.batch} x seq {args.seq}, AdamW, fp32; {args.ranks} simulated GPUs, "
        f"{args.rounds} rounds of {args.steps} steps each, interleaved"
    )
    print(f"  raw fully_shard loop      : {cpu_ms['raw']:8.2f} ms CPU per step (median; wall {wall_ms['raw']:.2f} ms)")
    print(
        f"  through Accelerator       : {cpu_ms['accel']:8.2f} ms CPU per step (median; wall {wall_ms['accel']:.2f} ms)"
    )
    print(
        f"  ratio Accelerator / raw: {cpu_ms['accel'] / cpu_ms['raw']:.3f}x "
        f"(wall {wall_ms['accel'] / wall_ms['raw']:.3f}x; target <= 1.05x)"
    )
    worst = max(
        abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"]["accel"], r["losses"]["raw"], strict=True)
    )
    print(f"  fp32 losses, Accelerator vs raw: largest relative difference {worst:.1e}")


if __name__ == "__main__":
    main()
