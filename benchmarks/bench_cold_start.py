"""Benchmark of the cold start, as users meet it: a pytest session whose one test is a 4-rank
distributed test vs a session whose one test is plain, both in modules that import torch
at the top (as real test files do).

Both sessions run in fresh pytest processes, alternately, several rounds, so that they
are measured side by side under the same load; the figures are the difference and the
ratio of the medians (the goal: at most 0.5 s more than the plain session). The
distributed session pays for whatever starts the ranks (a rank server, its torch import,
the first pool) and for closing them.

A rank server outlives a session (`accel.sim.runtime.server`), so the edit-test loop finds one
running: the rounds measure that. `--no-server` measures sessions that each start their
own ranks from nothing (ACCEL_SIM_SERVER=0, as under CI); `--first` also measures the very
first session, which finds no server (each such round stops it first): its ranks come from
a fork of the session itself once it imported torch, and it starts the server as it ends;
the same session with that fork turned off (ACCEL_SIM_SELF_FORK=0: a fresh server imports
torch again, beside the session) is measured in the same rounds for comparison.

The sessions' rank servers live in a folder of this benchmark's own (TMPDIR), so that
stopping them never touches another session's.

    python benchmarks/bench_cold_start.py [--rounds 7] [--world_size 4] [--no-server] [--first]
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

PLAIN = """
import torch


def test_plain():
    assert torch.ones(1).item() == 1
"""

DISTRIBUTED = """
import torch
import torch.distributed as dist

from harness import distributed_test


@distributed_test(world_size={world_size}, device="cpu")
def test_distributed(rank, world_size):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size
"""


#: records how long the session's one test took (setup, call and teardown: the distributed
#: test waits there for its ranks) and the session's own end (closing the ranks)
TIMING = """
import json, os, time
import pytest

_times = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        _times["test"] = time.perf_counter() - start


@pytest.hookimpl(wrapper=True)
def pytest_unconfigure(config):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        _times["end"] = time.perf_counter() - start
        with open(os.environ["BENCH_TIMES"], "w") as handle:
            json.dump(_times, handle)
"""


def session(path: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall time of a fresh pytest session running the tests of `path`; and of its test and end."""
    times_file = path + ".times.json"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench_timing", path],
        capture_output=True,
        text=True,
        env={**env, "BENCH_TIMES": times_file, "PYTHONPATH": os.path.dirname(path)},
        cwd=os.path.dirname(path),
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"session {path} failed:\n{done.stdout}\n{done.stderr}")
    with open(times_file) as handle:
        inside = json.load(handle)
    return elapsed, inside["test"] + inside["end"]


def stop_servers(env: dict[str, str]) -> None:
    """Stop the rank servers this benchmark's sessions would use (the next one starts afresh)."""
    subprocess.run([sys.executable, "-m", "accel.sim.runtime.server", "stop"], env=env, check=True, capture_output=True)
    # A server still importing torch (started as the last session ended) stops once it serves.
    folder = os.path.join(env["TMPDIR"], f"accel-sim-{os.getuid()}")
    deadline = time.monotonic() + 120
    while os.path.isdir(folder) and any(name.endswith(".sock") for name in os.listdir(folder)):
        if time.monotonic() > deadline:
            raise SystemExit(f"the rank servers of {folder} did not stop within 120 s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--no-server", action="store_true", help="sessions start their own ranks (ACCEL_SIM_SERVER=0)")
    parser.add_argument("--first", action="store_true", help="also time the first session, which starts the server")
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if args.no_server:
        env["ACCEL_SIM_SERVER"] = "0"
    kinds = ("plain", "distributed", "first", "first-nofork", "nofork")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    inner: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="accel-cold-") as folder:
        env["TMPDIR"] = os.path.join(folder, "tmp")
        os.mkdir(env["TMPDIR"])
        nofork = {**env, "ACCEL_SIM_SELF_FORK": "0"}
        plain = os.path.join(folder, "test_plain.py")
        distributed = os.path.join(folder, "test_distributed.py")
        with open(plain, "w") as handle:
            handle.write(PLAIN)
        with open(distributed, "w") as handle:
            handle.write(DISTRIBUTED.format(world_size=args.world_size))
        with open(os.path.join(folder, "bench_timing.py"), "w") as handle:
            handle.write(TIMING)
        session(plain, env)  # file caches warm for both
        session(distributed, env)
        for index in range(args.rounds):
            order = ["plain", "distributed"] if index % 2 == 0 else ["distributed", "plain"]
            if args.no_server:
                order.append("nofork")
            elif args.first:
                order += ["first", "first-nofork"] if index % 2 == 0 else ["first-nofork", "first"]
            for kind in order:
                if kind.startswith("first"):
                    stop_servers(env)
                wall, inside = session(
                    plain if kind == "plain" else distributed, nofork if kind.endswith("nofork") else env
                )
                times[kind].append(wall)
                inner[kind].append(inside)
        if not args.no_server:
            stop_servers(env)

    plain_median = statistics.median(times["plain"])
    print(
        f"session with one plain test (module imports torch):   median {plain_median:.2f} s  {_spread(times['plain'])}"
    )
    rows = [("distributed", ", ranks forked from the session" if args.no_server else "")]
    if times["nofork"]:
        rows.append(("nofork", ", ranks from a fresh fork server (ACCEL_SIM_SELF_FORK=0)"))
    if times["first"]:
        rows.append(("first", ", first session (no server yet: ranks forked from the session)"))
        rows.append(("first-nofork", ", first session, a fresh server imports torch (ACCEL_SIM_SELF_FORK=0)"))
    for key, what in rows:
        median = statistics.median(times[key])
        name = f"session with one {args.world_size}-rank distributed test{what}"
        print(f"{name}: median {median:.2f} s  {_spread(times[key])}")
        pairs = [d - p for p, d in zip(times["plain"], times[key], strict=False)]
        print(
            f"  first distributed test over the plain session: {median - plain_median:+.2f} s "
            f"(ratio {median / plain_median:.2f}; median of paired differences {statistics.median(pairs):+.2f} s)"
        )
        extra = statistics.median(inner[key]) - statistics.median(inner["plain"])
        print(f"  inside the session (its test and its end, less the plain one's): {extra:+.3f} s")


def _spread(values: list[float]) -> str:
    return "(" + ", ".join(f"{value:.2f}" for value in values) + ")"


if __name__ == "__main__":
    main()
