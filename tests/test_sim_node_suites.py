"""Other people's GPU test suites and self-launching frameworks, unchanged, on a simulated node.

The suites (tests/suites/*.py, written as PyTorch's and Accelerate's own GPU tests are)
run with pytest in a subprocess of their own (pytester), under `ACCEL_SIMULATE=cuda:2` or
`pytest --simulate cuda:2`: every test must pass, none may skip. Without either, the
PyTorch-bases file must skip every test, which shows that its GPU gate is real. Lightning
starts its own ranks from a script run with plain `python` (tests/programs/node_lightning.py).

Each run of the PyTorch-bases file costs about 40 s of CPU (every test spawns 2 processes
that import torch and its test utilities): `make test` runs it once, under the variable as
the held-out checks do; the same file under `--simulate`, its run without a node, Accelerate's
bigger script and Lightning are `frameworks`-marked (`make test-frameworks`). A small file
checks `--simulate` itself in `make test`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: starts whole processes as a user would: `make test-frameworks` (CI's second step) runs these
pytestmark = pytest.mark.processes

pytest_plugins = ["pytester"]

SUITES = Path(__file__).resolve().parent / "suites"
PROGRAMS = Path(__file__).resolve().parent / "programs"
NO_HYPOTHESIS = ("-p", "no:hypothesispytest")
#: a launcher's or the simulator's variables that would change what a suite sees
OUTSIDE = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "CUDA_", "PJRT_")
RESULT = re.compile(r"^RESULT (\{.*\})$", re.MULTILINE)


@pytest.fixture
def suite(pytester, monkeypatch):
    """`suite(name)`: tests/suites/<name>.py as the pytester folder's test_<name>.py, in a clean environment."""
    for name in list(os.environ):
        if name.startswith(OUTSIDE):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # this environment's console scripts (`accelerate`, `torchrun`) first, as in an activated venv
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))

    def make(name: str) -> None:
        pytester.makepyfile(**{f"test_{name}": (SUITES / f"{name}.py").read_text()})

    return make


def outcome(result: pytest.RunResult) -> str:
    return (result.stdout.str() + result.stderr.str())[-8000:]


# -- PyTorch's test bases -------------------------------------------------------------------------


def test_a_suite_on_pytorchs_test_bases_passes_under_the_variable(pytester, suite, monkeypatch):
    """As the held-out checks run suites: the variable in pytest's environment (pytest-xdist's
    workers under the node: `test_pytest_simulate_puts_the_session_its_workers_...` below)."""
    suite("torch_bases")
    monkeypatch.setenv("ACCEL_SIMULATE", "cuda:2")
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-rs", timeout=400)
    assert result.ret == 0, outcome(result)
    result.assert_outcomes(passed=4, skipped=0)


@pytest.mark.frameworks
def test_a_suite_on_pytorchs_test_bases_passes_under_pytest_simulate(pytester, suite):
    suite("torch_bases")
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "--simulate", "cuda:2", "-rs", timeout=400)
    assert result.ret == 0, outcome(result)
    result.assert_outcomes(passed=4, skipped=0)


@pytest.mark.frameworks
def test_the_same_suite_skips_without_a_simulated_node(pytester, suite):
    """Its gate (`skip_if_lt_x_gpu(2)`) is real: without a node this machine has no GPU, and every test skips."""
    suite("torch_bases")
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-rs", timeout=400)
    assert result.ret == 0, outcome(result)
    result.assert_outcomes(passed=0, skipped=4)


SESSION = """
import os, subprocess, sys
import torch


AT_IMPORT = torch.cuda.device_count()  # as suites' gates read it (TEST_CUDA, TEST_MULTIGPU)
PROBE = "import os, torch; print(torch.cuda.device_count(), torch.cuda.get_device_name(), os.environ['ACCEL_SIM_NODE'])"


def test_the_session_sees_the_node():
    assert AT_IMPORT == 2 and torch.cuda.is_available() and torch.cuda.get_device_name(1) == "NVIDIA L4"


def test_a_process_the_test_starts_is_on_the_same_node():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["2", "NVIDIA", "L4", os.environ["ACCEL_SIM_NODE"]]
"""


def test_pytest_simulate_puts_the_session_its_workers_and_their_children_on_the_node(pytester, suite):
    pytester.makepyfile(test_session=SESSION)
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "--simulate", "cuda:2,gpu=L4", "-n", "2", timeout=300)
    assert result.ret == 0, outcome(result)
    result.assert_outcomes(passed=2, skipped=0)


# -- Accelerate's style: `accelerate launch` in a subprocess ---------------------------------------


def test_an_accelerate_style_multi_gpu_test_passes_under_pytest_simulate(pytester, suite):
    suite("accelerate_style")
    result = pytester.runpytest_subprocess(
        *NO_HYPOTHESIS, "--simulate", "cuda:2", "-s", "-rs", "-k", "test_device or test_ops", timeout=400
    )
    assert result.ret == 0, outcome(result)
    result.assert_outcomes(passed=2, skipped=0)
    # `accelerate launch` found the node's 2 GPUs itself, and its ranks ran on them with NCCL
    assert "More than one GPU was found, enabling multi-GPU training." in outcome(result)
    result.stdout.fnmatch_lines(["*Distributed environment: DistributedType.MULTI_GPU  Backend: nccl*"])
    result.stdout.fnmatch_lines(["*Device: cuda:0*"])


@pytest.mark.frameworks
def test_accelerates_own_test_script_passes_under_pytest_simulate(pytester, suite):
    """Accelerate's bigger `test_utils/scripts/test_script.py` (RNG sync, data loaders, training, ...)."""
    suite("accelerate_style")
    result = pytester.runpytest_subprocess(
        *NO_HYPOTHESIS, "--simulate", "cuda:2", "-rs", "-k", "test_script", timeout=600
    )
    assert result.ret == 0, outcome(result)
    result.assert_outcomes(passed=1, skipped=0)


# -- Lightning starting its own ranks -------------------------------------------------------------


@pytest.mark.frameworks
def test_lightning_started_with_plain_python_starts_its_ranks_on_the_node():
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTSIDE)}
    env.update(ACCEL_SIMULATE="cuda:2", OMP_NUM_THREADS="1")
    program = PROGRAMS / "node_lightning.py"
    done = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=600)
    output = (done.stdout + done.stderr)[-8000:]
    assert done.returncode == 0, output
    results = sorted((json.loads(line) for line in RESULT.findall(done.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], output
    for rank, result in enumerate(results):
        assert result["world_size"] == 2 and result["device_count"] == 2
        assert result["root_device"] == f"cuda:{rank}" and result["devices_seen"] == [f"cuda:{rank}"]
        assert result["strategy"] == "DDPStrategy" and result["wrappers"] == ["DistributedDataParallel"]
        assert result["global_step"] == 4
    assert results[0]["pid"] != results[1]["pid"] and results[0]["node"] == results[1]["node"]
    assert results[1]["local_rank_env"] == "1"  # started by Lightning, not by a launcher
    assert results[0]["weights"] == results[1]["weights"]
    reference = results[0]["reference"]  # the same steps on the CPU in one process
    assert results[0]["weights"] == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert not os.path.exists(results[0]["node"])
