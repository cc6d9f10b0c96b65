"""Benchmark: what `accel_simulate.pth` costs Python processes, without `ACCEL_SIMULATE` and with it.

The package installs `accel_simulate.pth` at the top of site-packages, so `site` runs its
one line in every Python process of the environment: without the variable it is an
environment lookup (`os` is imported already), with it the process joins or creates a
simulated node and boots the simulated device once it imports torch (`accel.sim.node`).
The claim to check: without the variable the cost is nil.

What is measured, and why this way:

1. The .pth itself: `site.addpackage(site-packages, "accel_simulate.pth", ...)`, what `site`
   does with that file at start-up (read it, exec its line), timed in this process many times,
   with the variable unset; an empty .pth, alternately in the same rounds, shows the share any
   file has (open and read it), the rest is our line. This is the whole of what the file adds to a process without the
   variable, measured with a timer fine enough to see it. A process-level "with the file vs
   without it" is not measured: it would need the file removed from site-packages (this
   benchmark does not edit the environment), and `python -S` / `-I` are no baseline, as they
   skip all of site-packages (or change more than this file). Tens of microseconds would be
   lost in the noise of process start-up anyway: (1) is then set against (2)'s `python -c pass`.
2. Fresh interpreters, as users start them: `python -c pass` and `python -c "import torch"`,
   each without the variable and with `ACCEL_SIMULATE=cuda:2`, interleaved within each round
   (the order flips every round) so that both share the machine's load. Each is timed in wall
   time and in the child's CPU time (user + system, from `wait4`; on a loaded machine it
   measures the work done, which wall time does not). Medians over rounds, ratios with/without.
   With the variable, `python -c pass` pays for reading the variable and making (and removing)
   the node's folder; `import torch` also for booting the simulated GPUs.

    python benchmarks/bench_node_startup.py [--rounds 7] [--pth-repeats 2000]
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

PTH = "accel_simulate.pth"
ENV = "ACCEL_SIMULATE"
NODE = "cuda:2"
PROGRAMS = {"python -c pass": "pass", 'python -c "import torch"': "import torch"}
BUDGET_US = 1000.0  # what "nil" means here: under a millisecond per process, far under `python -c pass`


def site_packages() -> str:
    """The site-packages folder that holds the .pth (this interpreter's purelib)."""
    folder = sysconfig.get_paths()["purelib"]
    if not os.path.exists(os.path.join(folder, PTH)):
        sys.exit(f"{PTH} is not in {folder}: install the package (pip install -e .) first")
    return folder


def time_pth(folder: str, repeats: int) -> tuple[list[float], list[float]]:
    """Microseconds `site` spends on the .pth, and on an empty .pth (any file's share: open, read),
    alternately, `repeats` times each, without the variable."""
    os.environ.pop(ENV, None)
    with tempfile.TemporaryDirectory() as empty_folder:
        open(os.path.join(empty_folder, "empty.pth"), "w").close()
        ours, empty = [], []
        for _ in range(repeats):
            for samples, where, name in ((ours, folder, PTH), (empty, empty_folder, "empty.pth")):
                start = time.perf_counter()
                site.addpackage(where, name, set())
                samples.append((time.perf_counter() - start) * 1e6)
    return ours, empty


def percentile(samples: list[float], fraction: float) -> float:
    return sorted(samples)[int(len(samples) * fraction)]


def clean_env(simulate: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    if simulate:
        env[ENV] = NODE
    return env


def run_once(code: str, simulate: bool) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh interpreter running `code`."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], env=clean_env(simulate), stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"{code!r} ({'with' if simulate else 'without'} {ENV}) failed with status {child.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pth-repeats", type=int, default=2000)
    args = parser.parse_args()

    folder = site_packages()
    pth, empty = time_pth(folder, args.pth_repeats)
    pth_median, empty_median = statistics.median(pth), statistics.median(empty)

    times: dict[tuple[str, bool], list[tuple[float, float]]] = {(n, s): [] for n in PROGRAMS for s in (False, True)}
    for code in PROGRAMS.values():
        run_once(code, False), run_once(code, True)  # warm-up: the file cache
    for round_index in range(args.rounds):
        for name, code in PROGRAMS.items():
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for simulate in order:
                times[(name, simulate)].append(run_once(code, simulate))

    print(f"{PTH} in {folder}")
    print(f"python {sys.version.split()[0]}, {args.rounds} rounds, each program without and with {ENV}={NODE}")
    print()
    print(f"1. site's work on {PTH} without {ENV} ({args.pth_repeats} times in this process):")
    print(f"   median {pth_median:.1f} us (min {min(pth):.1f} us, 90th percentile {percentile(pth, 0.9):.1f} us)")
    print(f"   an empty .pth, in the same rounds: median {empty_median:.1f} us (min {min(empty):.1f} us)")
    print()
    print(
        f"2. fresh interpreters (medians; wall / CPU):{'':14}without {ENV}    with {ENV}={NODE}    ratio (wall / CPU)"
    )
    medians = {}
    for name in PROGRAMS:
        without = [statistics.median(t[i] for t in times[(name, False)]) for i in (0, 1)]
        with_ = [statistics.median(t[i] for t in times[(name, True)]) for i in (0, 1)]
        medians[name] = without
        print(
            f"   {name:<28} {without[0] * 1e3:7.1f} / {without[1] * 1e3:7.1f} ms"
            f"   {with_[0] * 1e3:7.1f} / {with_[1] * 1e3:7.1f} ms"
            f"      {with_[0] / without[0]:.2f} / {with_[1] / without[1]:.2f}"
        )
    print()
    share = pth_median / (medians["python -c pass"][0] * 1e6)
    print(
        f"without {ENV}: the .pth costs {pth_median:.1f} us per process, "
        f"{share:.3%} of `python -c pass` ({medians['python -c pass'][0] * 1e3:.1f} ms)"
    )
    print(f"budget: nil (< {BUDGET_US:.0f} us per process) -> {'OK' if pth_median < BUDGET_US else 'OVER'}")


if __name__ == "__main__":
    main()
