"""Benchmark of the pytest harness: wall time per trivial 4-rank test, warm and cold.

Writes a suite of trivial `@distributed_test(world_size=4)` tests (one all_reduce
each) and runs it with pytest in a fresh process, several rounds. Warm tests reuse the
pool's ranks; for scale, each warm test is interleaved with the same test declared
`isolated=True`, which forks fresh ranks from the preloaded fork server (a
fork-per-launch runner) — so both are measured side by side under the same load. The
first test of each session is the cold start: fork server, torch import, first pool.

Also times `accel.sim.launch` alone (no pytest) on a warm pool.

    python benchmarks/bench_harness.py [--tests 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SUITE = """
from harness import distributed_test


def _one_all_reduce(world_size):
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size

{tests}
"""

TEST = """
@distributed_test(world_size=4{isolated})
def test_{name}_{index:03d}(world_size):
    _one_all_reduce(world_size)
"""

#: records each test's wall time (setup + call + teardown + report) into a JSON file
TIMING_PLUGIN = """
import json, os, time
import pytest

_times = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        _times.append((item.name, time.perf_counter() - start))


def pytest_sessionfinish(session):
    with open(os.environ["BENCH_TIMES"], "w") as handle:
        json.dump(_times, handle)
"""


def write_suite(directory: str, count: int) -> str:
    tests = []
    tests.append(TEST.format(name="first", index=0, isolated=""))
    for index in range(count):
        tests.append(TEST.format(name="warm", index=index, isolated=""))
        tests.append(TEST.format(name="isolated", index=index, isolated=", isolated=True"))
    path = os.path.join(directory, "test_bench_suite.py")
    with open(path, "w") as handle:
        handle.write(SUITE.format(tests="".join(tests)))
    with open(os.path.join(directory, "conftest.py"), "w") as handle:
        handle.write(TIMING_PLUGIN)
    return path


def run_session(directory: str) -> tuple[float, list[tuple[str, float]]]:
    times_file = os.path.join(directory, "times.json")
    env = {**os.environ, "BENCH_TIMES": times_file}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        "-p",
        "no:randomly",
    ]
    start = time.perf_counter()
    result = subprocess.run(command + [directory], cwd=directory, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"the benchmark suite failed:\n{result.stdout}\n{result.stderr}")
    with open(times_file) as handle:
        return wall, [tuple(entry) for entry in json.load(handle)]


def launch_latency(count: int) -> float:
    """Median seconds of a warm `accel.sim.launch` of one all_reduce on 4 ranks (no pytest)."""
    from accel.sim import launch

    launch(_all_reduce, world_size=4)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        launch(_all_reduce, world_size=4)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=30, help="warm (and as many isolated) tests per session")
    parser.add_argument("--rounds", type=int, default=3, help="pytest sessions to run")
    args = parser.parse_args()

    cold, session_walls, warm_medians, isolated_medians, ratios = [], [], [], [], []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="accel-bench-harness-") as directory:
            write_suite(directory, args.tests)
            wall, times = run_session(directory)
        first = [t for name, t in times if name.startswith("test_first")]
        warm = [t for name, t in times if name.startswith("test_warm")]
        isolated = [t for name, t in times if name.startswith("test_isolated")]
        cold.append(first[0])
        session_walls.append(wall)
        warm_medians.append(statistics.median(warm))
        isolated_medians.append(statistics.median(isolated))
        ratios.append(statistics.median(i / w for w, i in zip(warm, isolated, strict=True)))
        print(
            f"round {round_index + 1}: first test {first[0]:.2f} s, warm {warm_medians[-1] * 1e3:.1f} ms/test, "
            f"isolated {isolated_medians[-1] * 1e3:.1f} ms/test, session {wall:.1f} s"
        )

    launch_ms = launch_latency(50) * 1e3
    print()
    print(f"trivial 4-rank test (one all_reduce), per test, median of {args.rounds} sessions x {args.tests} tests:")
    print(f"  warm ranks (pytest harness)          {statistics.median(warm_medians) * 1e3:8.1f} ms")
    print(f"  fresh ranks per test (isolated=True) {statistics.median(isolated_medians) * 1e3:8.1f} ms")
    print(f"  fresh / warm, median of pairs        {statistics.median(ratios):8.1f} x")
    cold_s, session_s = statistics.median(cold), statistics.median(session_walls)
    print(f"  first test of a session (cold)       {cold_s:8.2f} s  (fork server, torch import, first pool)")
    print(f"  whole session ({1 + 2 * args.tests} tests)             {session_s:8.2f} s  (includes pytest start)")
    print(f"  accel.sim.launch alone, warm         {launch_ms:8.1f} ms")


if __name__ == "__main__":
    main()
