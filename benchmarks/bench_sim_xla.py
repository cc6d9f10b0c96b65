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

import _side_by_side as sbs


def _step_timer(on_tpu: bool, width: int, layers: int, batch: int, group):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device() if on_tpu else torch.device("cpu")
    model, optimizer, x, y = sbs.mlp(device, width, layers, batch)
    world = dist.get_world_size()

    def tpu_step() -> None:
        xm.optimizer_step(optimizer)
        torch_xla.sync()

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

    return sbs.step_timer(model, optimizer, x, y, tpu_step if on_tpu else cpu_step)


def side_by_side(width: int, layers: int, batch: int, steps: int, rounds: int) -> dict:
    """In a simulated TPU rank: alternate blocks of steps on the TPU core and on the CPU."""
    import torch.distributed as dist

    from accel.state import PartialState

    PartialState()  # the "xla" process group, as accel makes it on a TPU
    gloo = dist.new_group(backend="gloo")
    tpu_run, tpu_losses = _step_timer(True, width, layers, batch, gloo)
    cpu_run, cpu_losses = _step_timer(False, width, layers, batch, gloo)
    pairs = sbs.interleave(tpu_run, cpu_run, steps, rounds)
    return {"pairs": pairs, "equal_losses": tpu_losses == cpu_losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.add_arguments(parser)
    args = parser.parse_args()
    from accel.sim import launch

    results = launch(side_by_side, args=sbs.shape(args), world_size=args.ranks, device="xla", timeout=600)
    labels = ("step on simulated xla (optimizer_step + sync)", "step on cpu, same rank (all_reduce + step)   ")
    sbs.report(args, results, "xla", "simulated TPU cores", labels)


if __name__ == "__main__":
    main()
