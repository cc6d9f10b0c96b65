"""Batches per second of a prepared loader vs a plain DataLoader with DistributedSampler.

Two simulated CPU ranks (`accel.sim.launch`, real Gloo process group). In each rank,
both contenders iterate the same data (a TensorDataset of small tensors, batch 16,
shuffled): a `DataLoader` over a `DistributedSampler`, and the same `DataLoader`
(`shuffle=True`) prepared by `prepare_data_loader` the way `Accelerator.prepare` does it
(device placement on, the sampler's generator synchronised). Each round times two
epochs of each, in the order A B B A, so that machine noise hits both alike. Prints,
per rank, the median time per batch of each and the median of the per-round ratios
prepared / plain (1.00: same cost; the target is at most 1.05).
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

    def epoch(loader, index: int) -> tuple[float, int]:
        loader.set_epoch(index) if hasattr(loader, "set_epoch") else sampler.set_epoch(index)
        count = 0
        start = time.perf_counter()
        for _ in loader:
            count += 1
        return time.perf_counter() - start, count

    ours, theirs, ratios = [], [], []
    epoch(prepared, 0), epoch(plain, 0)  # warm-up
    for index in range(1, rounds + 1):
        # A B B A: both contenders see the same drift of the machine's load within a round.
        (a1, n_plain), (b1, n_ours) = epoch(plain, index), epoch(prepared, index)
        (b2, _), (a2, _) = epoch(prepared, index), epoch(plain, index)
        if n_ours != n_plain:
            raise RuntimeError(f"the loaders disagree on the number of batches: {n_ours} vs {n_plain}")
        ours.append((b1 + b2) / (2 * n_ours))
        theirs.append((a1 + a2) / (2 * n_plain))
        ratios.append((b1 + b2) / (a1 + a2))
    return {"ours": statistics.median(ours), "theirs": statistics.median(theirs), "ratio": statistics.median(ratios)}


def main() -> None:
    from accel.sim import launch

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    results = launch(rank_main, args=(rounds, SAMPLES, BATCH), world_size=2, device="cpu", timeout=600)
    print(f"2 Gloo ranks, TensorDataset of {SAMPLES} x (8 floats, 1 int), batch {BATCH}, shuffled; median of {rounds} rounds")
    for rank, result in enumerate(results):
        print(
            f"rank {rank}: prepared {result['ours'] * 1e6:7.1f} us/batch   DataLoader+DistributedSampler "
            f"{result['theirs'] * 1e6:7.1f} us/batch   ratio {result['ratio']:.3f}"
        )
    print(f"median ratio prepared / plain: {statistics.median(r['ratio'] for r in results):.3f}")


if __name__ == "__main__":
    main()
