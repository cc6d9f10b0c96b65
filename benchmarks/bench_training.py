"""Training step: an `Accelerator` loop vs a hand-written DDP loop, on 2 simulated CPU ranks.

Both loops train the same small MLP on the same data with SGD on the same Gloo process
group. The hand-written one is what people write without accel: a `DataLoader` with a
`DistributedSampler`, `DistributedDataParallel`, `loss.backward()`, `optimizer.step()`.
The accel one is the same script through `Accelerator.prepare` and
`accelerator.backward`. Each round runs one epoch of each, interleaved step by step
(alternating which goes first), and times every step including the fetch of its batch;
the slower rank's total counts. Prints the median over rounds of the ratio
accel / hand-written (1.00 = no overhead).

    python benchmarks/bench_training.py [--rounds 41] [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

FEATURES, HIDDEN, BATCH = 32, 64, 16


def _make_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _rank_main(rounds: int, steps: int) -> list[tuple[float, float]]:
    """Runs in each rank: the per-round epoch times (hand-written, accel) of the slower rank."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from accel.accelerator import Accelerator

    torch.set_num_threads(1)  # two ranks share the machine's cores
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH * world, FEATURES, generator=generator)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loss_fn = torch.nn.functional.mse_loss

    # hand-written DDP
    raw_model = DistributedDataParallel(_make_model(torch))
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    raw_loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))

    def raw_step(batch) -> None:
        inputs, targets = batch
        raw_opt.zero_grad()
        loss = loss_fn(raw_model(inputs), targets)
        loss.backward()
        raw_opt.step()

    # accel
    accelerator = Accelerator()
    model = _make_model(torch)
    acc_model, acc_opt, acc_loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(dataset, batch_size=BATCH, shuffle=False)
    )

    def accel_step(batch) -> None:
        inputs, targets = batch
        acc_opt.zero_grad()
        loss = loss_fn(acc_model(inputs), targets)
        accelerator.backward(loss)
        acc_opt.step()

    def round_times() -> tuple[float, float]:
        """One epoch of each, step by step in turns; (hand-written, accel) seconds, slower rank's."""
        clock = time.perf_counter
        spent = [0.0, 0.0]
        contenders = [(iter(raw_loader), raw_step, 0), (iter(acc_loader), accel_step, 1)]
        dist.barrier()
        for i in range(steps):
            # Alternate who goes first, so neither always follows the other's communication.
            for batches, step, slot in contenders if i % 2 == 0 else contenders[::-1]:
                start = clock()
                step(next(batches))
                spent[slot] += clock() - start
        for batches, _, _ in contenders:
            next(batches, None)  # let each loader finish its epoch (outside the timing)
        totals = torch.tensor(spent, dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        return totals[0].item(), totals[1].item()

    round_times()  # warm-up: DDP bucket rebuild, allocator, lazy imports
    return [round_times() for _ in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--steps", type=int, default=50, help="training steps per epoch and rank")
    args = parser.parse_args()

    from accel.sim import launch

    results = launch(_rank_main, args=(args.rounds, args.steps), world_size=2, device="cpu", timeout=600)[0]
    ratios = [acc / raw for raw, acc in results]
    raw_ms = statistics.median(raw for raw, _ in results) / args.steps * 1e3
    acc_ms = statistics.median(acc for _, acc in results) / args.steps * 1e3
    print(
        f"training step, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, batch {BATCH}/rank, 2 ranks (Gloo), "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    print(f"  hand-written DDP : {raw_ms:.3f} ms/step (median)")
    print(f"  accel            : {acc_ms:.3f} ms/step (median)")
    print(
        f"  ratio accel / DDP: median {statistics.median(ratios):.3f}  (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
