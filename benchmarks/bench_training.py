"""Training step: an `Accelerator` loop vs the same hand-written DDP loop, on 2 ranks (CPU and simulated GPUs).

What a user writes without accel: a `DataLoader` over a `DistributedSampler` (shuffled,
`set_epoch` every epoch), the model moved to the rank's device and wrapped in
`DistributedDataParallel`, each batch moved to the device, `loss.backward()`,
`optimizer.step()`, `optimizer.zero_grad()`. What a user writes with accel: the same
script through `from accel import Accelerator`, `accelerator.prepare(model, optimizer,
loader)` and `accelerator.backward(loss)`. Both train the same small MLP with SGD in the
same ranks, on the same process group, 2 ranks launched by `accel.sim.launch` (as
`accel launch --simulate {cpu,cuda} --num_processes 2` does): CPU ranks (Gloo) and
simulated GPU ranks (NCCL semantics carried by Gloo).

A round is one epoch of each loop, interleaved step by step (which loop goes first
alternates), each step timed with the fetch of its batch; the epoch's start (`iter`) and
end (the last `next`) count too, as they do in a `for` loop. Two clocks: wall time of the
slower rank, and CPU time of the ranks' main threads (the Python and kernels a step runs,
which on a busy machine moves less than wall time does). Which loop is built first
alternates between launches (the objects' places in memory shift timings by a percent or
two). Each launch runs `--rounds` rounds; the ratio accel / hand-written of every round
of every launch gives the median and the spread (quartiles, extremes; 1.00 = no overhead,
the floor is 1.03).

    python benchmarks/bench_training.py [--device cpu|cuda|both] [--launches 3] [--rounds 15] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

FEATURES, HIDDEN, BATCH = 32, 64, 16
FLOOR = 1.03


def _make_model(torch):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _rank_main(rounds: int, steps: int, accel_first: bool) -> list[tuple[float, float, float, float]]:
    """In each rank: per round (hand-written wall, accel wall, hand-written cpu, accel cpu), the max over ranks."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from accel import Accelerator

    torch.set_num_threads(1)  # two ranks share the machine's cores
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH * world, FEATURES, generator=generator)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loss_fn = torch.nn.functional.mse_loss

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)

    def hand_written() -> tuple[DataLoader, DistributedSampler, Callable]:
        model = DistributedDataParallel(_make_model(torch).to(device), device_ids=[device] if on_gpu else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = DistributedSampler(dataset, shuffle=True)

        def step(batch) -> None:  # type: ignore[no-untyped-def]
            inputs, targets = batch
            inputs, targets = inputs.to(device), targets.to(device)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return DataLoader(dataset, batch_size=BATCH, sampler=sampler), sampler, step

    def with_accel() -> tuple[DataLoader, Callable]:
        accelerator = Accelerator()
        model = _make_model(torch)
        model, optimizer, loader = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(dataset, batch_size=BATCH, shuffle=True)
        )
        if accelerator.device != device:
            raise RuntimeError(f"the two loops train on different devices: {accelerator.device} and {device}")

        def step(batch) -> None:  # type: ignore[no-untyped-def]
            inputs, targets = batch
            loss = loss_fn(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

        return loader, step

    # The objects' places in memory shift timings by a percent or two: launches alternate
    # which loop is built first.
    if accel_first:
        acc_loader, accel_step = with_accel()
        raw_loader, sampler, raw_step = hand_written()
    else:
        raw_loader, sampler, raw_step = hand_written()
        acc_loader, accel_step = with_accel()

    wall, cpu = time.perf_counter, time.thread_time

    def round_times(epoch: int) -> tuple[float, float, float, float]:
        spent = [0.0, 0.0, 0.0, 0.0]  # wall raw, wall accel, cpu raw, cpu accel
        sampler.set_epoch(epoch)  # the hand-written loop's duty; the prepared loader does it itself
        contenders = [(raw_loader, raw_step, 0), (acc_loader, accel_step, 1)]
        batches: list = [None, None]
        dist.barrier(device_ids=[device.index] if on_gpu else None)
        for i in range(steps + 2):  # iter(), the steps, the last next() that ends the epoch
            # Alternate who goes first, so neither always follows the other's communication.
            for loader, step, slot in contenders if i % 2 == 0 else contenders[::-1]:
                start_wall, start_cpu = wall(), cpu()
                if i == 0:
                    batches[slot] = iter(loader)
                elif i <= steps:
                    step(next(batches[slot]))
                elif next(batches[slot], None) is not None:
                    raise RuntimeError("an epoch is longer than the steps asked for")
                spent[slot] += wall() - start_wall
                spent[2 + slot] += cpu() - start_cpu
        totals = torch.tensor(spent, dtype=torch.float64, device=device)  # NCCL takes device tensors only
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        return tuple(totals.tolist())  # type: ignore[return-value]

    round_times(0)  # warm-up: DDP bucket rebuild, allocator, lazy imports
    return [round_times(epoch) for epoch in range(1, rounds + 1)]


def spread(ratios: list[float]) -> str:
    """Median, quartiles and extremes of `ratios`."""
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return f"median {median:.3f}  (quartiles {q1:.3f}-{q3:.3f}, range {min(ratios):.3f}-{max(ratios):.3f})"


def measure(device: str, launches: int, rounds: int, steps: int) -> dict[str, float]:
    """Launch 2 ranks on `device` `launches` times; print the figures; return the median ratios by clock."""
    from accel.sim import launch

    results: list[tuple[float, float, float, float]] = []
    per_launch: dict[str, list[float]] = {"wall": [], "cpu": []}
    for number in range(launches):
        got = launch(_rank_main, args=(rounds, steps, number % 2 == 1), world_size=2, device=device, timeout=600)[0]
        results += got
        per_launch["wall"].append(statistics.median(acc / raw for raw, acc, _, _ in got))
        per_launch["cpu"].append(statistics.median(acc / raw for _, _, raw, acc in got))
    print(
        f"training step, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, SGD, batch {BATCH}/rank, 2 {device} ranks, "
        f"{launches} launches x {rounds} rounds x {steps} steps"
    )
    medians = {}
    for clock, raw_at, acc_at in (("wall", 0, 1), ("cpu", 2, 3)):
        raw_ms = statistics.median(r[raw_at] for r in results) / (steps + 2) * 1e3
        acc_ms = statistics.median(r[acc_at] for r in results) / (steps + 2) * 1e3
        ratios = [r[acc_at] / r[raw_at] for r in results]
        medians[clock] = statistics.median(ratios)
        print(
            f"  {clock:>4}: hand-written DDP {raw_ms:.3f} ms/step, accel {acc_ms:.3f} ms/step; "
            f"accel / DDP {spread(ratios)}"
        )
    for clock, medians_of_launches in per_launch.items():
        print(f"  {clock} ratio, median of each launch: {' '.join(f'{m:.3f}' for m in medians_of_launches)}")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="both", help="ranks' device")
    parser.add_argument("--launches", type=int, default=3, help="launches of 2 ranks (per device)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per launch")
    parser.add_argument("--steps", type=int, default=40, help="training steps per epoch and rank")
    args = parser.parse_args()
    devices = ("cpu", "cuda") if args.device == "both" else (args.device,)
    summary = {device: measure(device, args.launches, args.rounds, args.steps) for device in devices}
    for device, medians in summary.items():
        print(
            f"step median accel / DDP, {device} ranks: wall {medians['wall']:.3f}, cpu {medians['cpu']:.3f} "
            f"(floor {FLOOR})"
        )


if __name__ == "__main__":
    main()
