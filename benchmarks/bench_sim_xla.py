"""Benchmark of simulated TPU cores: a training step on simulated XLA tensors against the same step on the CPU.

Each of `--ranks` simulated TPU ranks builds the same MLP twice (`--layers` hidden
layers of `--width`, batch `--batch`, AdamW): one copy on its TPU core (`torch_xla.device()`),
one on plain CPU tensors, torch on one thread. A step is what a torch_xla program does:
forward, backward, `xm.optimizer_step` (gradients all-reduced over the replicas, then the
optimizer's step) and `torch_xla.sync()`; the CPU copy all-reduces its gradients over a
Gloo group the same way (sum, then scale) before its step. The two are timed (CPU time)
alternately, `--steps` steps at a time, for `--rounds` rounds, so both run side by side
under the same load; the ratio of each pair of blocks is reported (median and range over
pairs and ranks). The fp32 losses of the two copies are compared: they must be equal.

    python benchmarks/bench_sim_xla.py [--ranks 2] [--width 256] [--layers 2] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _step_timer(on_tpu: bool, width: int, layers: int, batch: int, group):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch_xla.device() if on_tpu else torch.device("cpu")
    blocks: list[torch.nn.Module] = []
    size = width
    for _ in range(layers):
        blocks += [torch.nn.Linear(size, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=generator).to(device)
    y = torch.randn(batch, 1, generator=generator).to(device)
    world = dist.get_world_size()
    losses: list[float] = []

    def cpu_step() -> None:
        # as xm.optimizer_step reduces the gradients: one flat all-reduce, scaled, copied back
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.mul_(1.0 / world)
        offset = 0
        with torch.no_grad():
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        optimizer.step()

    def run(steps: int) -> float:
        # CPU time of this process (torch on one thread): on a loaded machine it measures
        # the work done, which wall time does not
        start = time.process_time()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if on_tpu:
                xm.optimizer_step(optimizer)
                torch_xla.sync()
            else:
                cpu_step()
            losses.append(loss.item())
        return time.process_time() - start

    return run, losses


def side_by_side(width: int, layers: int, batch: int, steps: int, rounds: int) -> dict:
    """In a simulated TPU rank: alternate blocks of steps on the TPU core and on the CPU."""
    import torch.distributed as dist

    from accel.state import PartialState

    PartialState()  # the "xla" process group, as accel makes it on a TPU
    gloo = dist.new_group(backend="gloo")
    tpu_run, tpu_losses = _step_timer(True, width, layers, batch, gloo)
    cpu_run, cpu_losses = _step_timer(False, width, layers, batch, gloo)
    tpu_run(3), cpu_run(3)  # warm-up
    pairs = []
    for _ in range(rounds):
        tpu_time, cpu_time = tpu_run(steps), cpu_run(steps)
        pairs.append((tpu_time / steps, cpu_time / steps))
    return {"pairs": pairs, "equal_losses": tpu_losses == cpu_losses}


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
    results = launch(side_by_side, args=shape, world_size=args.ranks, device="xla", timeout=600)
    ratios = [tpu / cpu for result in results for tpu, cpu in result["pairs"]]
    tpu_ms = statistics.median(tpu for result in results for tpu, _ in result["pairs"]) * 1e3
    cpu_ms = statistics.median(cpu for result in results for _, cpu in result["pairs"]) * 1e3
    print(
        f"MLP {args.layers}x{args.width}, batch {args.batch}, AdamW; {args.ranks} simulated TPU cores, "
        f"{args.rounds} rounds of {args.steps} steps, interleaved"
    )
    print(f"  step on simulated xla (optimizer_step + sync): {tpu_ms:.3f} ms (median)")
    print(f"  step on cpu, same rank (all_reduce + step)   : {cpu_ms:.3f} ms (median)")
    print(
        f"  ratio simulated xla / cpu: {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs; target <= 2x)"
    )
    print(f"  fp32 losses equal on xla and cpu: {all(result['equal_losses'] for result in results)}")


if __name__ == "__main__":
    main()
