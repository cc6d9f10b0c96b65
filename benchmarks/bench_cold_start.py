"""Benchmark of the cold start: a pytest session whose one test is distributed vs one whose test only imports torch.

Both sessions run in fresh processes, alternately, several rounds, so that they are
measured side by side under the same load. The distributed session pays for the fork
server (which imports torch, as the plain session does in its own process) and for
starting the first pool of ranks; the figure that matters is the difference of the
medians (the goal: at most 0.5 s).

    python benchmarks/bench_cold_start.py [--rounds 5] [--world_size 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PLAIN = """
import torch


def test_plain():
    assert torch.ones(1).item() == 1
"""

DISTRIBUTED = """
from harness import distributed_test


@distributed_test(world_size={world_size}, device="cpu")
def test_distributed(rank, world_size):
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size
"""


def session(path: str) -> float:
    """Wall time of a fresh pytest session running the tests of `path`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(path),
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"session {path} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world_size", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="accel-cold-") as folder:
        plain = os.path.join(folder, "test_plain.py")
        distributed = os.path.join(folder, "test_distributed.py")
        with open(plain, "w") as handle:
            handle.write(PLAIN)
        with open(distributed, "w") as handle:
            handle.write(DISTRIBUTED.format(world_size=args.world_size))
        session(plain)  # file caches warm for both
        times: dict[str, list[float]] = {"plain": [], "distributed": []}
        for _ in range(args.rounds):
            times["plain"].append(session(plain))
            times["distributed"].append(session(distributed))

    plain_median = statistics.median(times["plain"])
    dist_median = statistics.median(times["distributed"])
    print(f"session with one plain test importing torch:  median {plain_median:.2f} s  {_spread(times['plain'])}")
    print(
        f"session with one {args.world_size}-rank distributed test: "
        f"median {dist_median:.2f} s  {_spread(times['distributed'])}"
    )
    print(
        f"cold start of the first distributed test: +{dist_median - plain_median:.2f} s "
        f"(ratio {dist_median / plain_median:.2f})"
    )


def _spread(values: list[float]) -> str:
    return "(" + ", ".join(f"{value:.2f}" for value in values) + ")"


if __name__ == "__main__":
    main()
