"""Benchmark of the simulator's collective check: its cost on a collective-heavy task, and how fast a mismatch fails.

Three configurations run side by side, in rounds that interleave them (so that they
share the machine's load alike), on warm pools of 4 simulated CPU ranks:

- off:    ``check_collectives=False`` (collectives are still counted and shown on the
          board the deadlock check reads);
- on:     the default: every collective's signature is compared across ranks through
          the rendezvous store before it runs;
- torch:  off, plus torch's own checker, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (its
          ProcessGroupWrapper compares a fingerprint with a helper Gloo group).

Measured: the time per collective inside the ranks (a loop of small all_reduces, the
slowest rank's time), the wall time of one warm launch of a collective-heavy task, and
the time until a mismatched collective (all_reduce on rank 0, broadcast elsewhere)
fails the launch, and the time until a deadlock (rank 0 in an all_reduce the others,
which returned, never join) fails it.

    python benchmarks/bench_collective_check.py [--collectives 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from accel.sim import DistributedFailure
from accel.sim.runtime.manager import new_manager


def reduce_loop(count: int) -> float:
    """Seconds this rank spent in `count` all_reduces of a 16-element tensor."""
    import torch
    import torch.distributed as dist

    value = torch.ones(16)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(value)
    return time.perf_counter() - started


def mismatched() -> None:
    import torch
    import torch.distributed as dist

    value = torch.ones(16)
    if dist.get_rank() == 0:
        dist.all_reduce(value)
    else:
        dist.broadcast(value, src=0)


def lonely() -> None:
    """Rank 0 reduces alone: the others return at once (a deadlock)."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--collectives", type=int, default=200, help="all_reduces per task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()

    plain = new_manager(env={k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"})
    detail = new_manager(env={**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    configs = {"off": (plain, False), "on": (plain, True), "torch": (detail, False)}

    def run(name: str, fn, fn_args=(), timeout: float = 120) -> list:
        from accel.sim.runtime import launcher, serialize

        manager, check = configs[name]
        payload = serialize.dumps_call(fn, fn_args, {})
        outcomes = launcher.run_payload(
            payload, args.world_size, "cpu", timeout, manager=manager, check_collectives=check
        )
        launcher.raise_for_failures(outcomes, args.world_size, "cpu", timeout)
        return [serialize.loads(o.value) for o in outcomes]

    for name in configs:  # start the pools, warm every path once
        run(name, reduce_loop, (10,))

    per_collective: dict[str, list[float]] = {name: [] for name in configs}
    per_launch: dict[str, list[float]] = {name: [] for name in configs}
    to_failure: dict[str, list[float]] = {name: [] for name in configs}
    to_deadlock: list[float] = []
    for _ in range(args.rounds):
        for name in configs:
            started = time.perf_counter()
            seconds = run(name, reduce_loop, (args.collectives,))
            per_launch[name].append(time.perf_counter() - started)
            per_collective[name].append(max(seconds) / args.collectives)
        for name in ("on", "torch"):
            started = time.perf_counter()
            try:
                run(name, mismatched, timeout=60)
            except DistributedFailure as failure:
                to_failure[name].append(time.perf_counter() - started)
                if _ == 0:
                    print(f"[{name}] mismatch reported as: {failure.summary[:160]}")
            else:
                print(f"[{name}] a mismatched collective was not reported")
            run(name, reduce_loop, (1,))  # the failed launch threw its pool away: start the next one now
        started = time.perf_counter()
        try:
            run("on", lonely, timeout=60)
        except DistributedFailure as failure:
            to_deadlock.append(time.perf_counter() - started)
            if _ == 0:
                print(f"[on] deadlock reported as: {failure.summary[:160]}")
        run("on", reduce_loop, (1,))

    median = {name: statistics.median(values) for name, values in per_collective.items()}
    launches = {name: statistics.median(values) for name, values in per_launch.items()}
    print(f"\n{args.world_size} simulated cpu ranks, {args.collectives} all_reduces per task, {args.rounds} rounds")
    for name in configs:
        print(f"  {name:>5}: {median[name] * 1e6:8.1f} us per all_reduce, {launches[name] * 1e3:8.1f} ms per launch")
    print(f"ratio on/off per collective: {median['on'] / median['off']:.2f}")
    print(f"ratio on/off per launch:     {launches['on'] / launches['off']:.2f}")
    print(f"ratio torch DETAIL/off per collective: {median['torch'] / median['off']:.2f}")
    for name in ("on", "torch"):
        if to_failure[name]:
            print(f"mismatch fails the launch after {statistics.median(to_failure[name]):.2f} s ({name})")
    if to_deadlock:
        print(f"deadlock fails the launch after {statistics.median(to_deadlock):.2f} s (timeout 60 s)")
    plain.close()
    detail.close()


if __name__ == "__main__":
    main()
