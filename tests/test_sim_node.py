"""Any process tree on a simulated node (`ACCEL_SIMULATE`, `accel run`, `accel.sim.node`).

Each test runs a command as a user would on a GPU host, in a subprocess with a clean
environment: a script started with `mp.spawn`, `torchrun` started by the user, a parent
whose child outlives it, bad values of the variable. The programs are
tests/programs/node_*.py; each of their processes writes one `RESULT {json}` line. The
runs of other people's test suites and frameworks are in tests/test_sim_node_suites.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: starts whole processes as a user would: `make test-frameworks` (CI's second step) runs these
pytestmark = pytest.mark.processes

pytest_plugins = ["pytester"]

PROGRAMS = Path(__file__).resolve().parent / "programs"
BIN = Path(sys.executable).parent
RESULT = re.compile(r"^RESULT (\{.*\})$", re.MULTILINE)
#: what the forms of the variable look like in every refusal
FORMS = ("cuda:N", "cuda:N,gpu=NAME", "cuda:N,shapes_only", "xla:N")
#: a launcher's or the harness's variables that would change what a command sees
OUTSIDE = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "CUDA_", "PJRT_")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's or simulator's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTSIDE)}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def tool(name: str) -> str:
    """A console script of this environment (`accel`, `torchrun`), as a user runs it."""
    path = BIN / name
    assert path.exists(), f"{name} is not installed next to {sys.executable}"
    return str(path)


def run(command: list[str], env: dict[str, str], timeout: float = 240):
    """Run `command`; its exit status, its output (stdout then stderr) and the parsed RESULT lines."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    return done.returncode, output, [json.loads(line) for line in RESULT.findall(done.stdout)]


def by_rank(results: list[dict], count: int, output: str) -> list[dict]:
    """The RESULT of each rank 0..count-1, exactly one each."""
    assert sorted(r["rank"] for r in results) == list(range(count)), output[-6000:]
    return sorted(results, key=lambda r: r["rank"])


def accel_run(*command: str, gpus: int = 2, options: tuple[str, ...] = ()) -> list[str]:
    return [tool("accel"), "run", "--simulate", "cuda", "--gpus", str(gpus), *options, "--", *command]


def torchrun(program: str, *args: str) -> list[str]:
    return [tool("torchrun"), "--standalone", "--nproc_per_node", "2", str(PROGRAMS / program), *args]


def gone(pid: int, within: float = 0.0) -> bool:
    """Whether process `pid` has ended (a zombie counts as ended: it runs nothing), waiting up to `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("cuda:0", "'0'"),
        ("cuda:x", "'x'"),
        ("tpu:2", "'tpu'"),
        ("cuda:2,gpu=NOPE", "'NOPE'"),
        ("cuda:2,bogus", "'bogus'"),
        ("xla:2,gpu=L4", "cuda"),
    ],
)
def test_a_bad_value_stops_every_python_at_start(value, names):
    """Even a process that never imports torch: the value is refused before any of its code runs."""
    status, output, _ = run([sys.executable, "-c", "print('RAN')"], clean_env(ACCEL_SIMULATE=value), timeout=60)
    assert status == 2, output
    assert "RAN" not in output
    assert f"ACCEL_SIMULATE={value!r}" in output and names in output, output
    assert all(form in output for form in FORMS), output
    assert "Traceback" not in output, output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--simulate", "tpu", "--gpus", "2", "--", "python", "-c", "pass"], "invalid choice: 'tpu'"),
        (["--simulate", "cuda", "--gpus", "0", "--", "python", "-c", "pass"], "at least 1"),
        (["--simulate", "cuda", "--gpus", "2", "--gpu", "NOPE", "--", "python", "-c", "pass"], "unknown GPU 'NOPE'"),
        (["--simulate", "cuda", "--gpus", "two", "--", "python", "-c", "pass"], "invalid int value"),
        (["--gpus", "2", "--", "python", "-c", "pass"], "required: --simulate"),
        (["--simulate", "cuda", "--gpus", "2"], "give the command to run"),
    ],
)
def test_accel_run_refuses_bad_arguments_as_argparse_does(args, message):
    status, output, _ = run([tool("accel"), "run", *args], clean_env(), timeout=60)
    assert status == 2, output
    assert output.startswith("usage: accel run") and "accel run: error:" in output and message in output, output


def test_pytest_simulate_with_a_bad_value_is_a_usage_error(pytester):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:hypothesispytest", "--simulate", "cuda:0", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    errors = result.stderr.str()
    assert "--simulate='cuda:0'" in errors and "at least 1" in errors and "xla:N" in errors, errors


# -- processes without the variable --------------------------------------------------------------

PROBE = """
import sys
before = sorted(m for m in sys.modules if m == "accel" or m.startswith("accel."))
import torch
import accel

print(before, torch.cuda.device_count(), "accel.sim.node" in sys.modules, sep="|")
"""


def test_processes_without_the_variable_are_untouched_and_those_with_it_see_the_node():
    status, output, _ = run([sys.executable, "-c", PROBE], clean_env(), timeout=120)
    assert status == 0, output
    # nothing of accel was imported at start-up, no GPU appeared, `import accel` leaves the node alone
    assert output.strip() == "[]|0|False", output
    status, output, _ = run([sys.executable, "-c", PROBE], clean_env(ACCEL_SIMULATE="cuda:2"), timeout=120)
    assert status == 0, output
    before, count, node = output.strip().splitlines()[-1].split("|")
    assert "accel.sim.node.start" in before and count == "2" and node == "True", output


# -- mp.spawn -----------------------------------------------------------------------------------


def _load(program: str):
    spec = importlib.util.spec_from_file_location(f"node_program_{program}", PROGRAMS / f"{program}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_mp_spawn_ddp_script_trains_one_process_per_simulated_gpu():
    status, output, results = run(
        [sys.executable, str(PROGRAMS / "node_spawn_ddp.py")], clean_env(ACCEL_SIMULATE="cuda:2")
    )
    assert status == 0, output[-6000:]
    assert "DEVICES 2 True" in output
    ranks = by_rank(results, 2, output)
    for rank, result in enumerate(ranks):
        assert result["world"] == 2 and result["backend"] == "nccl"
        assert result["device"] == f"cuda:{rank}" and result["current_device"] == rank
        assert result["allocated"] > 0
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["losses"] == ranks[1]["losses"]
    program = _load("node_spawn_ddp")
    expected = program.reference()  # the whole batches, one CPU process
    assert ranks[0]["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    assert ranks[0]["weights"] == pytest.approx(expected["weights"], rel=1e-5, abs=1e-6)
    assert ranks[0]["weights"] != pytest.approx(program.flat(program.make_model()), abs=1e-3)  # it trained


# -- torchrun started by the user -----------------------------------------------------------------


def test_torchrun_started_by_the_user_under_accel_run_gives_each_rank_its_gpu():
    command = accel_run(*torchrun("node_torchrun.py", "plain"), options=("--gpu", "L4"))
    status, output, results = run(command, clean_env())
    assert status == 0, output[-6000:]
    ranks = by_rank(results, 2, output)
    for rank, result in enumerate(ranks):
        assert result["device_count"] == 2 and result["current_device"] == rank
        assert result["tensor_device"] == f"cuda:{rank}"
        assert result["all_reduce"] == [3.0, 3.0, 3.0] and result["backend"] == "nccl"
        assert result["name"] == "NVIDIA L4"
    assert ranks[0]["uuid"] != ranks[1]["uuid"]
    assert ranks[0]["node"] == ranks[1]["node"] is not None  # one node
    assert not os.path.exists(ranks[0]["node"])  # removed when the command ended


def test_two_ranks_of_one_group_on_one_gpu_are_refused_as_nccl_does():
    """The script forgot `torch.cuda.set_device(local_rank)`: both ranks on cuda:0."""
    status, output, results = run(accel_run(*torchrun("node_torchrun.py", "forgot")), clean_env())
    assert status != 0 and not results, output[-6000:]
    for rank in (0, 1):
        refusal = f"[rank{rank}]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0"
        assert refusal in output, output[-6000:]


def test_torchrun_under_the_variable_with_cuda_visible_devices_gives_each_rank_one_gpu_of_the_node():
    """torchrun started in the variable's environment; each rank sees only its own GPU, as cuda:0:
    distinct GPUs of the node (their UUIDs differ), so NCCL finds no duplicate."""
    status, output, results = run(torchrun("node_torchrun.py", "visible"), clean_env(ACCEL_SIMULATE="cuda:2,gpu=T4"))
    assert status == 0, output[-6000:]
    ranks = by_rank(results, 2, output)
    for rank, result in enumerate(ranks):
        assert result["visible"] == str(rank)
        assert result["device_count"] == 1 and result["current_device"] == 0 and result["tensor_device"] == "cuda:0"
        assert result["all_reduce"] == [3.0, 3.0, 3.0] and result["backend"] == "nccl"
        assert result["name"] == "Tesla T4"
    assert ranks[0]["uuid"] != ranks[1]["uuid"]  # two physical GPUs
    assert ranks[0]["node"] == ranks[1]["node"] is not None and not os.path.exists(ranks[0]["node"])
    assert "Duplicate GPU" not in output


UUIDS = "import torch; print(*(torch.cuda.get_device_properties(i).uuid for i in range(torch.cuda.device_count())))"


def test_cuda_visible_devices_remaps_the_nodes_gpus_in_each_process():
    """`CUDA_VISIBLE_DEVICES=3,1` on a 4-GPU node: cuda:0 is the node's GPU 3, cuda:1 its GPU 1."""
    status, output, _ = run([sys.executable, "-c", UUIDS], clean_env(ACCEL_SIMULATE="cuda:4"), timeout=120)
    assert status == 0, output
    physical = output.split()
    assert len(physical) == 4 and len(set(physical)) == 4, output
    env = clean_env(ACCEL_SIMULATE="cuda:4", CUDA_VISIBLE_DEVICES="3,1")
    status, output, _ = run([sys.executable, "-c", UUIDS], env, timeout=120)
    assert status == 0, output
    assert output.split() == [physical[3], physical[1]], output


def test_a_collective_mismatch_between_the_users_processes_is_reported_at_once():
    started = time.monotonic()
    status, output, _ = run(accel_run(*torchrun("node_torchrun.py", "mismatch")), clean_env(), timeout=180)
    elapsed = time.monotonic() - started
    assert status != 0, output[-6000:]
    assert "NOT REPORTED" not in output  # neither rank went on
    for rank in (0, 1):
        assert f"[rank{rank}]: accel.sim.diagnoses.failures.CollectiveMismatch: collective mismatch" in output, output
        assert f"[rank{rank}]:   rank 0: all_reduce(float32[3]) at " in output, output[-6000:]
        assert f"[rank{rank}]:   rank 1: broadcast(float32[4], src=0) at " in output, output[-6000:]
    assert elapsed < 120, f"reported after {elapsed:.0f} s: a hang, not at once"


# -- the node's memory ----------------------------------------------------------------------------


def test_two_processes_filling_one_gpu_together_run_out_of_its_memory(tmp_path):
    """No group between them: each takes 60% of cuda:0; the second runs out, as on one card.
    Shapes only: the 48 GiB are counted, not allocated."""
    command = torchrun("node_memory.py", str(tmp_path))
    status, output, results = run(command, clean_env(ACCEL_SIMULATE="cuda:2,shapes_only"))
    assert status == 0, output[-6000:]
    first, second = by_rank(results, 2, output)
    assert first["fit"] is True and first["allocated"] >= first["size"]
    assert second["free_before"] <= first["total"] - first["size"]  # mem_get_info shows the other's use
    assert second["fit"] is False and second["error"] == "OutOfMemoryError", second
    assert second["message"].startswith("CUDA out of memory. Tried to allocate "), second["message"]
    assert f"Process {first['pid']} has " in second["message"], second["message"]
    # alone, the same 60% fits
    status, output, results = run(
        [sys.executable, str(PROGRAMS / "node_memory.py"), str(tmp_path)],
        clean_env(ACCEL_SIMULATE="cuda:2,shapes_only"),
    )
    assert status == 0, output[-6000:]
    (alone,) = results
    assert alone["fit"] is True and alone["free_before"] > alone["size"], alone


# -- xla:N --------------------------------------------------------------------------------------


def test_torchrun_on_a_simulated_xla_node(tmp_path):
    status, output, results = run(torchrun("node_xla.py"), clean_env(ACCEL_SIMULATE="xla:2"))
    assert status == 0, output[-6000:]
    ranks = by_rank(results, 2, output)
    for rank, result in enumerate(ranks):
        assert result["device"] == "xla:0" and result["hw"] == "TPU"
        assert result["world_size"] == 2 and result["ordinal"] == rank
        assert result["xm_all_reduce"] == [3.0, 3.0, 3.0]
        assert result["dist_backend"] == "xla" and result["dist_all_reduce"] == [3.0, 3.0]
        assert result["cuda_device_count"] == 0


# -- nothing left behind --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["accel run", "ACCEL_SIMULATE"])
def test_nothing_of_the_node_is_left_running(tmp_path, how):
    """The command's child escapes its session (and ignores SIGTERM) and outlives it: it is stopped,
    the node's folder removed. Under `accel run`, a non-Python child in its process group too."""
    parent = [sys.executable, str(PROGRAMS / "node_leftover.py"), str(tmp_path)]
    if how == "accel run":
        command, env = accel_run(*parent, "--sleep"), clean_env()
    else:
        command, env = parent, clean_env(ACCEL_SIMULATE="cuda:2")
    pids: list[int] = []
    try:
        status, output, results = run(command, env, timeout=120)
        assert status == 0, output[-6000:]
        (result,) = results
        pids = [result["escaped"], *([result["sleep"]] if how == "accel run" else [])]
        assert result["escaped_session"] != result["session"]  # it escaped the command's process group
        assert all(gone(pid, within=1.0) for pid in pids), [p for p in pids if not gone(p)]
        assert not os.path.exists(result["node"])
    finally:
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_first_process_leaves_nothing_running(tmp_path, signum):
    """The node's first process is killed (no exit hook runs): its keeper stops what is left and removes the folder."""
    parent = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "node_leftover.py"), str(tmp_path), "--stay"],
        env=clean_env(ACCEL_SIMULATE="cuda:2"),
        stdout=subprocess.PIPE,
        text=True,
    )
    escaped = None
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]  # a pipe was asked for
        result = json.loads(line.split(" ", 1)[1])
        escaped = result["escaped"]
        assert os.path.isdir(result["node"]) and not gone(escaped)
        parent.send_signal(signum)
        parent.wait(timeout=60)
        assert gone(escaped, within=30.0)  # it ignores SIGTERM: killed after the grace period
        deadline = time.monotonic() + 10
        while os.path.exists(result["node"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(result["node"])
    finally:
        parent.kill()
        if escaped is not None and not gone(escaped):
            os.kill(escaped, signal.SIGKILL)


def test_a_card_described_by_its_figures_in_the_variable():
    """`gpu=memory=...,capability=...` is one card, although the variable's options are split at commas."""
    code = "import torch; p = torch.cuda.get_device_properties(0); print('CARD', p.total_memory, p.major, p.minor)"
    status, output, _ = run(
        [sys.executable, "-c", code], clean_env(ACCEL_SIMULATE="cuda:2,gpu=memory=24GiB,capability=8.9,shapes_only")
    )
    assert status == 0, output[-3000:]
    assert f"CARD {24 << 30} 8 9" in output
