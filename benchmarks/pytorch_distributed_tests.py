"""Run PyTorch's own distributed test files on simulated GPUs and count what passes.

PyTorch's tests for FSDP2, tensor parallelism, DTensor, distributed checkpointing,
pipelining and the NCCL process group are the most exact statement of what those
features expect of a GPU. This runs each file, unchanged, with pytest under
``ACCEL_SIMULATE=cuda:N`` (one file at a time: each test spawns world-size processes)
and prints one row per file (passed, failed, errors, skipped, seconds) and a total, so
that the next torch version's run is one command. Failures are data: it exits 0 when it
ran, non-zero only for bad arguments or a missing folder.

``--tests`` is a folder laid out as PyTorch's repository (``test/distributed/...``)
holding the test files of the installed torch's version; they are not part of accel.

    python benchmarks/pytorch_distributed_tests.py --tests /tmp/ptests [--gpus 4]
        [--files 'test/distributed/tensor/parallel/*.py' ...] [--timeout 900]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SELECTION = [
    "test/distributed/_composable/fsdp/test_*.py",
    "test/distributed/tensor/parallel/test_*.py",
    "test/distributed/tensor/test_dtensor*.py",
    "test/distributed/tensor/test_redistribute.py",
    "test/distributed/tensor/test_math_ops.py",
    "test/distributed/checkpoint/fsdp/test_*.py",
    "test/distributed/pipelining/test_schedule*.py",
    "test/distributed/test_c10d_nccl.py",
]
COLUMNS = ("passed", "failed", "errors", "skipped")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", required=True, type=Path, help="folder laid out as PyTorch's repo")
    parser.add_argument("--gpus", type=int, default=4, help="simulated GPUs on the node")
    parser.add_argument("--files", nargs="+", default=SELECTION, help="globs relative to --tests")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file")
    parser.add_argument("--keep", type=Path, help="folder to keep each file's junit xml and output in")
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.timeout <= 0:
        parser.error("--gpus and --timeout must be positive")
    if not args.tests.is_dir():
        parser.error(f"--tests {args.tests}: no such folder")
    return args


def select(root: Path, globs: list[str]) -> list[Path]:
    """The files the globs name under root, each once, in the order of the globs."""
    found: dict[Path, None] = {}
    for pattern in globs:
        for path in sorted(root.glob(pattern)):
            if path.is_file():
                found.setdefault(path, None)
    return list(found)


def counts(junit: Path) -> dict[str, int]:
    """Passed, failed, errors and skipped from a pytest junit xml file."""
    totals = dict.fromkeys(COLUMNS, 0)
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests = int(suite.get("tests", 0))
        for name, attr in (("failed", "failures"), ("errors", "errors"), ("skipped", "skipped")):
            totals[name] += int(suite.get(attr, 0))
        totals["passed"] += tests - int(suite.get("failures", 0)) - int(suite.get("errors", 0))
        totals["passed"] -= int(suite.get("skipped", 0))
    return totals


def run_file(path: Path, root: Path, gpus: int, timeout: float, out: Path) -> tuple[dict[str, int], float, str]:
    """Run one test file with pytest on a simulated node; its counts, seconds and a note."""
    stem = str(path.relative_to(root)).replace("/", ".")
    junit = out / f"{stem}.xml"
    command = [sys.executable, "-m", "pytest", str(path), "-p", "no:cacheprovider", "-q", "-rfEs"]
    command += [f"--junit-xml={junit}"]
    env = dict(os.environ, ACCEL_SIMULATE=f"cuda:{gpus}")
    start = time.monotonic()
    with open(out / f"{stem}.log", "w") as log:
        # A session of its own, so that a timeout ends the ranks pytest spawned too.
        proc = subprocess.Popen(
            command, cwd=path.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
            note = "" if junit.exists() else f"no report (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            note = f"timed out after {timeout:.0f} s"
    seconds = time.monotonic() - start
    return (counts(junit) if junit.exists() else dict.fromkeys(COLUMNS, 0)), seconds, note


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.tests.resolve()
    files = select(root, args.files)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pytorch-dist-tests-") as tmp:
        out = args.keep or Path(tmp)
        width = max([len("file")] + [len(str(f.relative_to(root))) for f in files])
        header = f"{'file':<{width}}" + "".join(f"{c:>9}" for c in COLUMNS) + f"{'seconds':>9}"
        print(f"ACCEL_SIMULATE=cuda:{args.gpus}, {len(files)} files under {root}")
        print(header, flush=True)
        total, total_seconds = dict.fromkeys(COLUMNS, 0), 0.0
        for path in files:
            row, seconds, note = run_file(path, root, args.gpus, args.timeout, out)
            for c in COLUMNS:
                total[c] += row[c]
            total_seconds += seconds
            cells = "".join(f"{row[c]:>9}" for c in COLUMNS)
            print(f"{str(path.relative_to(root)):<{width}}{cells}{seconds:>9.0f}  {note}".rstrip(), flush=True)
        cells = "".join(f"{total[c]:>9}" for c in COLUMNS)
        print(f"{'total':<{width}}{cells}{total_seconds:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
