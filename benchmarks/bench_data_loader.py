"""Batches per second of a prepared loader vs a plain DataLoader with DistributedSampler.

Two simulated CPU ranks (`accel.sim.launch`, real Gloo process group). In each rank,
both contenders iterate the same data (a TensorDataset of small tensors, batch 16,
shuffled): a `DataLoader` over a `DistributedSampler`, and the same `DataLoader`
(`shuffle=True`) prepared by `prepare_data_loader` the way `Accelerator.prepare` does it
(device placement on, the sampler's generator synchronised). Each round times two
epochs of each, in the order A B B A, so that machine noise hits both alike. Prints,
per rank, the median time per batch of each and the median of the per-round ratios
prepared / plain (1.00: same cost; the target is at most 1.05), by CPU time of the
rank's process (what the loader itself costs, steady on a busy machine) and by wall
time (which also counts the time other programs take the CPU away).
"""

from __future__ import annotations

import statistics
import sys
import time

ROUNDS = 41
SAMPLES = 4096
BATCH = 16


def rank_main(rounds: int, samples: int, batch: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from accel.data_loader import prepare_data_loader
    from accel.state import PartialState

    torch.set_num_threads(1)
    state = PartialState()
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(samples, 8), torch.randint(0, 10, (samples,)))
    sampler = DistributedSampler(dataset, num_replicas=state.num_processes, rank=state.process_index, shuffle=True)
    plain = DataLoader(dataset, batch_size=batch, sampler=sampler)
    prepared = prepare_data_loader(
        DataLoader(dataset, batch_size=batch, shuffle=True), put_on_device=True, rng_types=["generator"]
    )

    def epoch(loader, index: int) -> tuple[float, float, int]:
        loader.set_epoch(index) if hasattr(loader, "set_epoch") else sampler.set_epoch(index)
        count = 0
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in loader:
            count += 1
        return time.perf_counter() - wall, time.process_time() - cpu, count

    samples_by_clock: dict[str, tuple[list, list, list]] = {"cpu": ([], [], []), "wall": ([], [], [])}
    epoch(prepared, 0), epoch(plain, 0)  # warm-up
    for index in range(1, rounds + 1):
        # A B B A: both contenders see the same drift of the machine's load within a round.
        a1, b1, b2, a2 = epoch(plain, index), epoch(prepared, index), epoch(prepared, index), epoch(plain, index)
        if a1[2] != b1[2]:
            raise RuntimeError(f"the loaders disagree on the number of batches: {b1[2]} vs {a1[2]}")
        for position, clock in ((1, "cpu"), (0, "wall")):
            ours, theirs, ratios = samples_by_clock[clock]
            ours.append((b1[position] + b2[position]) / (2 * b1[2]))
            theirs.append((a1[position] + a2[position]) / (2 * a1[2]))
            ratios.append((b1[position] + b2[position]) / (a1[position] + a2[position]))
    return {
        clock: {"ours": statistics.median(o), "theirs": statistics.median(t), "ratio": statistics.median(r)}
        for clock, (o, t, r) in samples_by_clock.items()
    }


def main() -> None:
    from accel.sim import launch

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    results = launch(rank_main, args=(rounds, SAMPLES, BATCH), world_size=2, device="cpu", timeout=600)
    print(
        f"2 Gloo ranks, TensorDataset of {SAMPLES} x (8 floats, 1 int), batch {BATCH}, shuffled; "
        f"median of {rounds} rounds"
    )
    for clock in ("cpu", "wall"):
        for rank, result in enumerate(results):
            r = result[clock]
            print(
                f"{clock:>4} time, rank {rank}: prepared {r['ours'] * 1e6:7.1f} us/batch   "
                "DataLoader+DistributedSampler "
                f"{r['theirs'] * 1e6:7.1f} us/batch   ratio {r['ratio']:.3f}"
            )
        median = statistics.median(r[clock]["ratio"] for r in results)
        print(f"{clock:>4} time: median ratio prepared / plain: {median:.3f}")


if __name__ == "__main__":
    main()
