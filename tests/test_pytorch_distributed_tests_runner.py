"""benchmarks/pytorch_distributed_tests.py: one row of counts per test file, a total, exit 0 when it ran."""

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent.parent / "benchmarks" / "pytorch_distributed_tests.py"

PASSING = """
import os


def test_on_the_simulated_node():
    assert os.environ["ACCEL_SIMULATE"] == "cuda:2"
"""

MIXED = """
import pytest


def test_passes():
    pass


def test_fails():
    assert 1 == 2


@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


def run_runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.processes
def test_counts_each_file_and_the_total(tmp_path):
    folder = tmp_path / "test" / "distributed" / "fake"
    folder.mkdir(parents=True)
    (folder / "test_ok.py").write_text(PASSING)
    (folder / "test_mixed.py").write_text(MIXED)
    result = run_runner("--tests", str(tmp_path), "--gpus", "2", "--files", "test/distributed/fake/test_*.py")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[0]: line.split()[1:5] for line in result.stdout.splitlines()[2:]}
    # passed, failed, errors, skipped
    assert rows["test/distributed/fake/test_ok.py"] == ["1", "0", "0", "0"], result.stdout
    assert rows["test/distributed/fake/test_mixed.py"] == ["1", "1", "0", "1"], result.stdout
    assert rows["total"] == ["2", "1", "0", "1"], result.stdout
    assert "ACCEL_SIMULATE=cuda:2, 2 files" in result.stdout


def test_a_missing_folder_is_an_error(tmp_path):
    result = run_runner("--tests", str(tmp_path / "absent"))
    assert result.returncode == 2
    assert "no such folder" in result.stderr
