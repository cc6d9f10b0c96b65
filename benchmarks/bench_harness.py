"""Benchmark of the pytest harness: wall time per trivial 4-rank test, warm and cold.

Writes suites of trivial `@distributed_test(world_size=4)` tests (one all_reduce each,
in a module that imports torch at the top, as test files do) and runs each with pytest
in a fresh process, the sessions alternating round after round so that they are
measured side by side under the same load:

- warm: the tests reuse the pool's ranks, with the collective check on (the default);
- warm, check off: the same with ``ACCEL_SIM_CHECK_COLLECTIVES=0``: the difference is
  what the check's own exchange costs;
- warm, check through shared memory: the check's signatures exchanged through a file the
  ranks map (``ACCEL_SIM_CHECK_EXCHANGE=shm``, opt-in) instead of the rendezvous store;
- isolated: each test declared `isolated=True`, which forks fresh ranks (a
  fork-per-launch runner), for scale. (In a session of their own: the killed ranks of
  one would otherwise slow the warm test after it.)

The first test of a warm session is its cold start (rank server or fork server, first
pool). Also times `accel.sim.launch` alone (no pytest) on a warm pool, check on and off.

    python benchmarks/bench_harness.py [--tests 60] [--rounds 5]
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
import torch
import torch.distributed as dist

from harness import distributed_test


def _one_all_reduce(world_size):
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


def write_suite(directory: str, count: int, isolated: bool) -> None:
    tests = []
    if not isolated:
        tests.append(TEST.format(name="first", index=0, isolated=""))
    name, flag = ("isolated", ", isolated=True") if isolated else ("warm", "")
    for index in range(count):
        tests.append(TEST.format(name=name, index=index, isolated=flag))
    with open(os.path.join(directory, "test_bench_suite.py"), "w") as handle:
        handle.write(SUITE.format(tests="".join(tests)))
    with open(os.path.join(directory, "conftest.py"), "w") as handle:
        handle.write(TIMING_PLUGIN)


def run_session(directory: str, env: dict[str, str]) -> tuple[float, list[tuple[str, float]]]:
    times_file = os.path.join(directory, "times.json")
    env = {**env, "BENCH_TIMES": times_file}
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


def launch_latency(count: int, check: bool) -> float:
    """Median seconds of a warm `accel.sim.launch` of one all_reduce on 4 ranks (no pytest)."""
    from accel.sim import launch

    launch(_all_reduce, world_size=4, check_collectives=check)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        launch(_all_reduce, world_size=4, check_collectives=check)
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
    parser.add_argument("--tests", type=int, default=60, help="tests per session")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three sessions")
    args = parser.parse_args()

    unchecked = {**os.environ, "ACCEL_SIM_CHECK_COLLECTIVES": "0"}
    through_store = {**os.environ, "ACCEL_SIM_CHECK_EXCHANGE": "shm"}  # (the "store" entry: the other exchange)
    kinds = {
        "warm": (False, dict(os.environ)),
        "unchecked": (False, unchecked),
        "store": (False, through_store),
        "isolated": (True, dict(os.environ)),
    }
    medians: dict[str, list[float]] = {kind: [] for kind in kinds}
    cold, walls = [], []
    with tempfile.TemporaryDirectory(prefix="accel-bench-harness-") as root:
        folders = {}
        for kind, (isolated, _) in kinds.items():
            folders[kind] = os.path.join(root, kind)
            os.mkdir(folders[kind])
            write_suite(folders[kind], args.tests, isolated)
        for round_index in range(args.rounds):
            line = []
            # The warm kinds in turn first (load drifts within a round); the isolated one last.
            warm_kinds = ["warm", "unchecked", "store"]
            shift = round_index % len(warm_kinds)
            for kind in [*warm_kinds[shift:], *warm_kinds[:shift], "isolated"]:
                env = kinds[kind][1]
                wall, times = run_session(folders[kind], env)
                per_test = [t for name, t in times if not name.startswith("test_first")]
                medians[kind].append(statistics.median(per_test))
                line.append(f"{kind} {medians[kind][-1] * 1e3:.1f} ms/test")
                if kind == "warm":
                    cold.append(next(t for name, t in times if name.startswith("test_first")))
                    walls.append(wall)
            print(f"round {round_index + 1}: first test {cold[-1]:.2f} s, " + ", ".join(line))

    launch_on, launch_off = launch_latency(100, True) * 1e3, launch_latency(100, False) * 1e3
    warm, unchecked_ms, store_ms, isolated_ms = (statistics.median(medians[kind]) * 1e3 for kind in kinds)
    # Paired by round (the sessions of a round ran one after the other, under the same load).
    check_pairs = [(on - off) * 1e3 for on, off in zip(medians["warm"], medians["unchecked"], strict=True)]
    store_pairs = [(store - on) * 1e3 for on, store in zip(medians["warm"], medians["store"], strict=True)]
    print()
    print(f"trivial 4-rank test (one all_reduce), per test, median of {args.rounds} sessions x {args.tests} tests:")
    best = min(medians["warm"]) * 1e3
    print(f"  warm ranks, collective check on (default) {warm:8.1f} ms  {_spread(medians['warm'])}, best {best:.1f}")
    print(
        f"  warm ranks, collective check off          {unchecked_ms:8.1f} ms  {_spread(medians['unchecked'])}"
        f"  (the check costs {warm - unchecked_ms:+.1f} ms; paired by round {statistics.median(check_pairs):+.1f} ms)"
    )
    print(
        f"  warm ranks, check through shared memory   {store_ms:8.1f} ms  {_spread(medians['store'])}"
        f"  (shared memory saves {warm - store_ms:+.1f} ms, ratio {store_ms / warm:.2f}; "
        f"paired by round {statistics.median(store_pairs):+.1f} ms)"
    )
    print(f"  fresh ranks per test (isolated=True)      {isolated_ms:8.1f} ms  ({isolated_ms / warm:.1f} x warm)")
    print(f"  first test of a warm session (cold)       {statistics.median(cold):8.2f} s  (rank server, first pool)")
    session = f"whole warm session ({1 + args.tests} tests)"
    print(f"  {session:<41} {statistics.median(walls):8.2f} s  (includes pytest start)")
    print(f"  accel.sim.launch alone, warm, check on    {launch_on:8.1f} ms")
    print(f"  accel.sim.launch alone, warm, check off   {launch_off:8.1f} ms")


def _spread(values: list[float]) -> str:
    return "(sessions: " + ", ".join(f"{value * 1e3:.1f}" for value in values) + ")"


if __name__ == "__main__":
    main()
