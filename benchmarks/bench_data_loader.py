"""Batches of a prepared loader vs a plain DataLoader with DistributedSampler, on 2 ranks (CPU and simulated GPUs).

Two ranks launched by `accel.sim.launch` (as `accel launch --simulate {cpu,cuda}
--num_processes 2` does). In each rank both contenders iterate the same data (a
TensorDataset of 4096 x (8 floats, 1 int label), batch 16, shuffled) the way their users
write it:

- plain: `DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset, shuffle=True))`,
  `sampler.set_epoch(epoch)` before each epoch, each batch moved with `.to(device)`;
- prepared: `Accelerator().prepare(DataLoader(dataset, batch_size=16, shuffle=True))`,
  whose batches arrive on the device.

A round is one epoch of each, interleaved batch by batch (which goes first alternates),
each fetch timed with the user's work on it; the epoch's start (`set_epoch`, `iter`) and
end (the last `next`) count too, as in a `for` loop. Drifts of the machine's load thus hit
both alike. Which contender is built first alternates between launches (the objects'
places in memory shift timings by a percent or two). Two clocks: CPU time of the rank's
main thread (what the loading itself costs, steadier on a busy machine) and wall time.
Prints per-batch times and the ratio prepared / plain over every round of both ranks and
all launches: median and spread (quartiles, extremes; 1.00 = same cost, the floor is 1.05).

    python benchmarks/bench_data_loader.py [--device cpu|cuda|both] [--launches 3] [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

SAMPLES = 4096
BATCH = 16
FLOOR = 1.05


def rank_main(rounds: int, samples: int, batch: int, prepared_first: bool) -> dict[str, list[float]]:
    """In each rank: per round, the ratio prepared / plain and the per-batch times, by clock."""
    import os

    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from accel import Accelerator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(samples, 8), torch.randint(0, 10, (samples,)))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")

    def build_plain() -> tuple[DataLoader, DistributedSampler]:
        sampler = DistributedSampler(dataset, shuffle=True)
        return DataLoader(dataset, batch_size=batch, sampler=sampler), sampler

    def build_prepared() -> object:
        return Accelerator().prepare(DataLoader(dataset, batch_size=batch, shuffle=True))

    if prepared_first:
        prepared = build_prepared()
        plain, sampler = build_plain()
    else:
        plain, sampler = build_plain()
        prepared = build_prepared()

    def plain_start(epoch: int) -> Iterator:
        sampler.set_epoch(epoch)
        return iter(plain)

    def plain_next(batches: Iterator) -> bool:
        batch = next(batches, None)
        if batch is None:
            return False
        inputs, labels = batch
        inputs, labels = inputs.to(device), labels.to(device)
        return True

    def prepared_start(epoch: int) -> Iterator:
        return iter(prepared)  # type: ignore[call-overload]

    last: list = [None]  # the prepared loader's last inputs, checked outside the timing

    def prepared_next(batches: Iterator) -> bool:
        batch = next(batches, None)
        if batch is None:
            return False
        inputs, labels = batch
        last[0] = inputs
        return True

    wall, cpu = time.perf_counter, time.thread_time
    contenders = [(plain_start, plain_next, 0), (prepared_start, prepared_next, 1)]

    def round_times(epoch: int) -> tuple[list[float], int]:
        """One epoch of each, batch by batch in turns: (wall plain, wall prepared, cpu plain, cpu prepared), batches."""
        spent = [0.0, 0.0, 0.0, 0.0]
        batches: list = [None, None]
        going = [True, True]
        count = 0
        while any(going):
            # Alternate who goes first, so that neither always runs on caches the other warmed.
            for start, advance, slot in contenders if count % 2 == 0 else contenders[::-1]:
                start_wall, start_cpu = wall(), cpu()
                if batches[slot] is None:
                    batches[slot] = start(epoch)
                else:
                    going[slot] = advance(batches[slot])
                spent[slot] += wall() - start_wall
                spent[2 + slot] += cpu() - start_cpu
            if going[0] != going[1]:
                raise RuntimeError("the loaders disagree on the number of batches")
            count += 1
        if last[0].device != device:
            raise RuntimeError(f"the prepared loader's batches are on {last[0].device}, not {device}")
        return spent, count - 2  # less the iter() and the next() that ended the epoch

    out: dict[str, list[float]] = {
        f"{clock}_{what}": [] for clock in ("cpu", "wall") for what in ("ratio", "ours", "theirs")
    }
    round_times(0)  # warm-up
    for epoch in range(1, rounds + 1):
        spent, count = round_times(epoch)
        for clock, at in (("wall", 0), ("cpu", 2)):
            theirs, ours = spent[at], spent[at + 1]
            out[f"{clock}_ratio"].append(ours / theirs)
            out[f"{clock}_ours"].append(ours / count)
            out[f"{clock}_theirs"].append(theirs / count)
    return out


def spread(ratios: list[float]) -> str:
    """Median, quartiles and extremes of `ratios`."""
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return f"median {median:.3f}  (quartiles {q1:.3f}-{q3:.3f}, range {min(ratios):.3f}-{max(ratios):.3f})"


def measure(device: str, launches: int, rounds: int) -> dict[str, float]:
    """Launch 2 ranks on `device` `launches` times; print the figures; return the median ratios by clock."""
    from accel.sim import launch

    merged: dict[str, list[float]] = {}
    per_launch: dict[str, list[float]] = {"cpu": [], "wall": []}
    for number in range(launches):
        results = launch(
            rank_main, args=(rounds, SAMPLES, BATCH, number % 2 == 1), world_size=2, device=device, timeout=600
        )
        for result in results:
            for key, values in result.items():
                merged.setdefault(key, []).extend(values)
        for clock, medians_of_launches in per_launch.items():
            medians_of_launches.append(statistics.median(r for result in results for r in result[f"{clock}_ratio"]))
    print(
        f"data loader, TensorDataset of {SAMPLES} x (8 floats, 1 int), batch {BATCH}, shuffled, 2 {device} ranks, "
        f"{launches} launches x {rounds} rounds"
    )
    medians = {}
    for clock in ("cpu", "wall"):
        ours, theirs = statistics.median(merged[f"{clock}_ours"]), statistics.median(merged[f"{clock}_theirs"])
        medians[clock] = statistics.median(merged[f"{clock}_ratio"])
        print(
            f"  {clock:>4}: DataLoader+DistributedSampler {theirs * 1e6:6.1f} us/batch, prepared {ours * 1e6:6.1f} "
            f"us/batch; prepared / plain {spread(merged[f'{clock}_ratio'])}"
        )
    for clock, medians_of_launches in per_launch.items():
        print(f"  {clock} ratio, median of each launch: {' '.join(f'{m:.3f}' for m in medians_of_launches)}")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="both", help="ranks' device")
    parser.add_argument("--launches", type=int, default=3, help="launches of 2 ranks (per device)")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds (epochs) per launch")
    args = parser.parse_args()
    devices = ("cpu", "cuda") if args.device == "both" else (args.device,)
    summary = {device: measure(device, args.launches, args.rounds) for device in devices}
    for device, medians in summary.items():
        print(
            f"loader median prepared / plain, {device} ranks: cpu {medians['cpu']:.3f}, wall {medians['wall']:.3f} "
            f"(floor {FLOOR})"
        )


if __name__ == "__main__":
    main()
