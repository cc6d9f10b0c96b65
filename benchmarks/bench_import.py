"""Cost of `import accel; from accel import Accelerator` after `import torch`.

Each sample is a fresh interpreter that imports torch first, then times our import
with perf_counter. If the peer library is installed, it is timed in the same rounds,
interleaved, and the ratio printed.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys

ROUNDS = 9
SNIPPETS = {
    "accel": "import accel; from accel import Accelerator",
    "accelerate": "import accelerate; from accelerate import Accelerator",
}
PROGRAM = "import time, torch\nt = time.perf_counter()\n{snippet}\nprint((time.perf_counter() - t) * 1000)\n"


def sample(snippet: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(snippet=snippet)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    contenders = [name for name in SNIPPETS if importlib.util.find_spec(name) is not None]
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(ROUNDS):
        for name in contenders:
            times[name].append(sample(SNIPPETS[name]))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:>10}: median {value:7.1f} ms over {ROUNDS} fresh interpreters (min {min(times[name]):.1f} ms)")
    if "accelerate" in medians:
        print(f"ratio accel / accelerate: {medians['accel'] / medians['accelerate']:.2f}")
    print(f"budget: 100 ms -> {'OK' if medians['accel'] <= 100 else 'OVER'}")


if __name__ == "__main__":
    main()
