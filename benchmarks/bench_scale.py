"""Benchmark of large simulated worlds: pool start and warm per-test cost at 8, 32 and 128 ranks.

For each world size, in one process: start a pool of simulated CPU ranks (fork server
already warm, so this is forking, process groups and the Gloo full mesh), then run a
trivial test (one all_reduce, checked) on the warm pool several times. Printed side
by side, with the ratios to the smallest world, so that the figures of one run compare.

    python benchmarks/bench_scale.py [--sizes 8 32 128] [--tests 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from accel.sim.runtime import forking, serialize
from accel.sim.runtime.launcher import raise_for_failures, run_payload
from accel.sim.runtime.manager import new_manager


def one_all_reduce(world_size: int) -> None:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--tests", type=int, default=5, help="warm tests per world size")
    args = parser.parse_args()

    # c10d warns about every client socket whose host name it cannot look up: 128 ranks, 128 lines.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    forking.warm_up()
    warm_manager = new_manager(max_warm_ranks=2)
    run_payload(serialize.dumps_call(one_all_reduce, (2,), {}), 2, "cpu", 120, manager=warm_manager)  # torch imported
    warm_manager.close()

    rows = []
    for size in args.sizes:
        manager = new_manager(max_warm_ranks=size)
        started = time.perf_counter()
        manager.release(manager.acquire(size, "cpu"), reusable=True)
        start = time.perf_counter() - started
        payload = serialize.dumps_call(one_all_reduce, (size,), {})
        costs = []
        for _ in range(args.tests):
            began = time.perf_counter()
            outcomes = run_payload(payload, size, "cpu", 600, manager=manager)
            costs.append(time.perf_counter() - began)
            raise_for_failures(outcomes, size, "cpu")
        manager.close()
        rows.append((size, start, statistics.median(costs)))
        print(f"  {size:4d} ranks: pool start {start:6.2f} s, warm test {statistics.median(costs) * 1000:7.1f} ms")

    base_start, base_test = rows[0][1], rows[0][2]
    print(f"\n{'ranks':>6} {'start (s)':>10} {'x':>6} {'warm test (ms)':>15} {'x':>6}")
    for size, start, cost in rows:
        print(f"{size:6d} {start:10.2f} {start / base_start:6.1f} {cost * 1000:15.1f} {cost / base_test:6.1f}")


if __name__ == "__main__":
    main()
