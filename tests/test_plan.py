"""`accel plan`: one program over a grid of layouts, one table fastest first; the grid's checks."""

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accel.commands import cli
from accel.commands.plan import Layout, Outcome, ordered, read_grid, table

ACCEL = str(Path(sys.executable).with_name("accel"))

#: a small FSDP2 training script: 4 Linear layers, AdamW, 3 steps on the GPU
SCRIPT = """
import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--fail", action="store_true")
args = parser.parse_args()
if args.fail:
    raise ValueError("this layout is refused")
dist.init_process_group("nccl")
torch.cuda.set_device(dist.get_rank())
model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4))).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    model(torch.randn(args.batch, 1024, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""

# in grid order: not the table's
GRID = """
[[layout]]
name = "four"
num_processes = 4
only_ranks = [0]
args = ["--batch", "512"]

[[layout]]
name = "too-big"
num_processes = 2
args = "--batch 100000"

[[layout]]
name = "two"
num_processes = 2
tokens_per_step = 4096

[[layout]]
name = "broken"
num_processes = 1
args = ["--fail"]
"""


def _median_step(report: Path) -> float:
    """A layout's step as the timing report gives it: the slowest rank's median."""
    ranks = json.loads(report.read_text())["ranks"].values()
    return max(statistics.median(step["time_s"] for step in rank["steps"]) for rank in ranks)


@pytest.mark.processes
def test_layouts_fastest_first_then_what_does_not_fit_then_what_failed(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "grid.toml").write_text(GRID)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "CUDA_"))}
    argv = ["plan", "--grid", "grid.toml", "--gpu", "memory=1GiB", "--tokens_per_step", "1024"]
    argv += ["--keep", "kept", "--json", "plan.json", "--", "python", "train.py"]
    done = subprocess.run([ACCEL, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    steps = {name: _median_step(tmp_path / "kept" / f"{name}.timing.json") for name in ("four", "two")}
    fastest_first = sorted(steps, key=steps.__getitem__)
    rows = done.stdout.splitlines()[2:]  # after the title and the header
    assert [row.split()[0] for row in rows] == [*fastest_first, "too-big", "broken"]
    assert "no (OOM)" in rows[2] and "tried to allocate" in rows[2]
    assert "failed" in rows[3] and "ValueError: this layout is refused" in rows[3]
    results = {result["layout"]: result for result in json.loads((tmp_path / "plan.json").read_text())}
    assert results["too-big"]["status"] == "does not fit" and 0.5 < results["too-big"]["peak_gib"] < 1
    for name, processes, tokens in (("four", 4, 1024), ("two", 2, 4096)):
        result = results[name]
        assert result["status"] == "fits" and result["step_s"] == pytest.approx(steps[name])
        assert result["tokens_per_s_per_gpu"] == pytest.approx(tokens / steps[name] / processes)
        # the figures of each rank's own end-of-run line (every rank here does what rank 0 does)
        log = (tmp_path / "kept" / f"{name}.log").read_text()
        assert f"MFU {result['mfu']:.1%}, exposed communication {result['exposed_comm_share']:.1%}" in log
        assert f"peak reserved {result['peak_gib'] * 1024:.2f} MiB" in log
    assert "accel plan: [1/4] four (4 GPUs, only_ranks 0) ..." in done.stderr
    assert "accel plan: [2/4] too-big: does not fit" in done.stderr


def _plan(tmp_path, capsys, grid: str, suffix: str = ".toml") -> tuple[int, str]:
    path = tmp_path / f"grid{suffix}"
    path.write_text(textwrap.dedent(grid))
    code = cli.main(["plan", "--grid", str(path), "--", "python", "train.py"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("grid", "error"),
    [
        ('[[layout]]\nname = "a"\nnum_processes = 2\nnum_procs = 4\n', "layout 1 ('a'): unknown key 'num_procs'"),
        ('[[layout]]\nname = "a"\n', "layout 1 ('a'): missing 'num_processes'"),
        ("[[layout]]\nnum_processes = 2\n", "layout 1: missing 'name'"),
        ('[[layout]]\nname = "a"\nnum_processes = 0\n', "'num_processes' must be a positive integer, got 0"),
        ('[[layout]]\nname = "a"\nnum_processes = 4\nonly_ranks = "0,7"\n', "outside the world of 4 ranks"),
        ('[[layout]]\nname = "a"\nnum_processes = 2\nargs = 3\n', "'args' is a list of the program's arguments"),
        ('[[layout]]\nname = "a"\nnum_processes = 2\ntokens_per_step = -1\n', "'tokens_per_step' must be a"),
        ('[[layout]]\nname = "a"\nnum_processes = 2\n[[layout]]\nname = "a"\nnum_processes = 4\n', "two layouts"),
        ('gpu = "H100"\n', "unknown top-level key 'gpu'"),
        ("", "no layout"),
        ("[[layout]\n", "not valid TOML"),
    ],
)
def test_grid_errors_say_what_to_fix(tmp_path, capsys, grid, error):
    code, err = _plan(tmp_path, capsys, grid)
    assert code == 2 and err.startswith("accel plan: ") and error in err


def test_grid_as_json_and_its_forms(tmp_path, capsys):
    grid = [{"name": "a", "num_processes": 8, "only_ranks": [0, 4], "args": "--tp 2 --note 'two words'"}]
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    (layout,) = read_grid(tmp_path / "grid.json")
    assert (layout.only_ranks, layout.args) == ("0,4", ("--tp", "2", "--note", "two words"))
    code, err = _plan(tmp_path, capsys, "name: a\n", suffix=".yaml")
    assert code == 2 and "give the grid as a .toml or .json file" in err
    (tmp_path / "ok.toml").write_text('[[layout]]\nname = "a"\nnum_processes = 2\n')
    assert cli.main(["plan", "--grid", str(tmp_path / "ok.toml"), "--"]) == 2
    assert "give the program after --" in capsys.readouterr().err


def test_order_by_step_or_by_throughput():
    def outcome(name, status, step=None, tokens=None):
        return Outcome(Layout(name, 8), status, 1.0, step_s=step, tokens_per_s_per_gpu=tokens)

    outcomes = [
        outcome("failed", "failed"),
        outcome("oom", "does not fit"),
        outcome("small-batch", "fits", step=1.0, tokens=500.0),
        outcome("untimed", "fits"),
        outcome("big-batch", "fits", step=3.0, tokens=900.0),
    ]
    assert [o.layout.name for o in ordered(outcomes)] == ["small-batch", "big-batch", "untimed", "oom", "failed"]
    by_throughput = [o.layout.name for o in ordered(outcomes, "throughput")]
    assert by_throughput == ["big-batch", "small-batch", "untimed", "oom", "failed"]
    rows = table(outcomes, "H100", "throughput").splitlines()
    assert rows[1].split()[:3] == ["layout", "GPUs", "fits"] and rows[2].split()[:3] == ["big-batch", "8", "yes"]
