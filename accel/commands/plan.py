"""`accel plan`: run one program over a grid of layouts on simulated GPUs, and say which is fastest.

Each layout is one `accel launch --simulate cuda --shapes_only` run of the same program, with the
layout's own world size, ranks run (`--only_ranks`) and extra program arguments, one after the
other in a subprocess. Each run's timing report (`--timing_report`) gives its predicted step, and
its ranks' end-of-run lines their peak memory; the table lists the layouts fastest first, then
those that ran out of memory, then those that failed, with the last line of their error.

Parsing and checking the grid is torch-free (`accel plan --help` and grid errors answer at once);
the figures are computed with the clock's own end-of-run summary (`accel.sim.cuda.timing.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GRID_HELP = """\
The grid (--grid FILE, .toml or .json) is a list of layouts, each a table with:
  name             (required) a name for the table, unique
  num_processes    (required) the world size: GPUs of the layout
  only_ranks       ranks run, standing in for the others (--only_ranks: "0", "0,32", [0, 32]);
                   for symmetric layouts (FSDP, HSDP, tensor parallel): "0"; default: every rank.
                   Not for pipeline parallelism: what a stage receives from another (its shapes)
                   cannot be stood in for, and such a run stops saying so; run every rank there
  args             extra program arguments of this layout (a list, or one string split as a shell does)
  tokens_per_step  tokens of one step over all ranks (default: --tokens_per_step), for tokens/s per GPU
  env              environment variables of this layout's run (a table of strings)

TOML:                                      JSON:
  [[layout]]                                 {"layout": [{"name": "fsdp64", "num_processes": 64,
  name = "fsdp64"                                         "only_ranks": "0", "args": ["--tp", "1"]}]}
  num_processes = 64                         (or the list alone)
  only_ranks = "0"
  args = ["--tp", "1"]

Each layout runs as: accel launch --simulate cuda --shapes_only --gpu GPU --num_processes N
[--only_ranks R] --timing_report ... [--network ...] [--gpus_per_node ...] [--tokens_per_step T]
[--timeout S] PROGRAM [its args] [the layout's args], one layout after the other.

The table, fastest first (shortest step; with --sort throughput most tokens/s per GPU, for layouts
whose global batches differ): peak GiB is the largest peak reserved of the ranks run; step the
predicted step (median of the steps the clock saw; of the slowest rank run); MFU executed FLOPs
against the card's dense BF16 peak; exposed comm the share of the step when a collective and no
compute ran. A run that failed with CUDA's out-of-memory error does not fit; one that failed
otherwise is listed with its error's last line. Exit status 0 once the table is printed, 2 for a
bad grid or command line."""

#: the keys a layout may have
LAYOUT_KEYS = ("name", "num_processes", "only_ranks", "args", "tokens_per_step", "env")
#: a rank's end-of-run memory line (no "[rank R]" prefix when one rank is shown)
END_LINE = re.compile(
    r"accel\.sim: (cuda:\d+) \(.*?\): peak allocated ([\d.]+) (bytes|KiB|MiB|GiB), "
    r"peak reserved ([\d.]+) (bytes|KiB|MiB|GiB)"
)
_UNIT = {"bytes": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0}
OUT_OF_MEMORY = re.compile(r"CUDA out of memory|OutOfMemoryError")
_TRIED = re.compile(r"CUDA out of memory\. Tried to allocate ([\d.]+ (?:bytes|KiB|MiB|GiB))")
_TIMED_OUT = re.compile(r"^(?:\[rank \d+\] )?timed out; its stack at that moment", re.MULTILINE)
_ERROR = re.compile(r"^(?:\[rank \d+\] )?((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b.*)$")


class GridError(ValueError):
    """The grid file cannot be used: says where and what to write instead."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout of the grid: the world, the ranks run, the program's extra arguments."""

    name: str
    num_processes: int
    only_ranks: str | None = None
    args: tuple[str, ...] = ()
    tokens_per_step: int | None = None
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass
class Outcome:
    """What one layout's run gave: fits / does not fit / failed, its peak and its predicted figures."""

    layout: Layout
    status: str  # "fits", "does not fit", "failed"
    seconds: float
    peak_gib: float | None = None
    step_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    exposed_comm_share: float | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["layout"] = self.layout.name
        return data


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `plan` sub-command."""
    parser = subparsers.add_parser(
        "plan",
        help="run a program over a grid of layouts on simulated GPUs: which fits, which is fastest",
        description="Run PROGRAM once per layout of --grid on simulated GPUs (shapes only) and print one "
        "table, fastest first: accel plan --grid layouts.toml --gpu H100 -- python -m torchtitan.train ...",
        epilog=GRID_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the program's own options are never taken for abbreviations of ours
    )
    parser.add_argument("--grid", required=True, metavar="FILE", help="the layouts (.toml or .json, see below)")
    parser.add_argument("--gpu", default="H100", metavar="NAME", help="the card of every GPU (default H100)")
    parser.add_argument("--tokens_per_step", type=int, metavar="N", help="tokens of one step over all ranks")
    parser.add_argument("--network", metavar="BANDWIDTH", help="each GPU's NIC between nodes, e.g. 400Gbps")
    parser.add_argument("--gpus_per_node", type=int, metavar="N", help="GPUs per node (default 8)")
    parser.add_argument(
        "--sort",
        choices=("step", "throughput"),
        default="step",
        help="fastest first by predicted step (default), or by tokens/s per GPU (layouts of different global batch)",
    )
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="give up a layout's run after this long")
    parser.add_argument("--keep", metavar="DIR", help="keep each layout's output and timing report in DIR")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="after --: the program and its arguments")
    parser.set_defaults(run=run, parser=parser)
    return parser


# -- the grid ---------------------------------------------------------------------------------


def read_grid(path: str | Path) -> list[Layout]:
    """The layouts of the grid file at `path` (.toml or .json), checked; GridError saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise GridError(f"{path}: no such grid file")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as error:
            raise GridError(f"{path}: not valid JSON: {error}") from None
    elif path.suffix == ".toml":
        data = _read_toml(path, text)
    else:
        raise GridError(f"{path}: give the grid as a .toml or .json file")
    entries = _entries(path, data)
    layouts = [_layout(path, index, entry) for index, entry in enumerate(entries, 1)]
    seen: set[str] = set()
    for layout in layouts:
        if layout.name in seen:
            raise GridError(f"{path}: two layouts are named {layout.name!r}; names must be unique")
        seen.add(layout.name)
    return layouts


def _read_toml(path: Path, text: str) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise GridError(f"{path}: reading TOML needs Python 3.11 or tomli; or write the grid as JSON") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise GridError(f"{path}: not valid TOML: {error}") from None


def _entries(path: Path, data: Any) -> list[Any]:
    """The list of layout tables: `layout` of the top-level table (a JSON list alone is taken too)."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"layout"})
        if unknown:
            raise GridError(f"{path}: unknown top-level key {unknown[0]!r}: the grid holds only 'layout' (a list)")
        data = data.get("layout")
    if not isinstance(data, list) or not data:
        raise GridError(f"{path}: no layout: give a list of layouts ([[layout]] tables in TOML, 'layout' in JSON)")
    return data


def _layout(path: Path, index: int, entry: Any) -> Layout:
    """Layout number `index` of the grid, checked."""
    where = f"{path}: layout {index}"
    if not isinstance(entry, dict):
        raise GridError(f"{where}: a layout is a table of {', '.join(LAYOUT_KEYS)}")
    if isinstance(entry.get("name"), str):
        where += f" ({entry['name']!r})"
    unknown = sorted(set(entry) - set(LAYOUT_KEYS))
    if unknown:
        raise GridError(f"{where}: unknown key {unknown[0]!r} (a layout's keys: {', '.join(LAYOUT_KEYS)})")
    for key in ("name", "num_processes"):
        if key not in entry:
            raise GridError(f"{where}: missing {key!r}")
    name, processes = entry["name"], entry["num_processes"]
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise GridError(f"{where}: 'name' must be a non-empty string without spaces, got {name!r}")
    if not _positive_int(processes):
        raise GridError(f"{where}: 'num_processes' must be a positive integer, got {processes!r}")
    tokens = entry.get("tokens_per_step")
    if tokens is not None and not _positive_int(tokens):
        raise GridError(f"{where}: 'tokens_per_step' must be a positive integer, got {tokens!r}")
    return Layout(
        name=name,
        num_processes=processes,
        only_ranks=_only_ranks(where, entry.get("only_ranks"), processes),
        args=_args(where, entry.get("args", [])),
        tokens_per_step=tokens,
        env=_env(where, entry.get("env", {})),
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _only_ranks(where: str, value: Any, world_size: int) -> str | None:
    """`only_ranks` as `--only_ranks` takes it ("0,32"), checked as `accel launch` checks it."""
    if value is None:
        return None
    if _positive_int(value) or value == 0:
        value = str(value)
    elif isinstance(value, list) and value and all(_positive_int(r) or r == 0 for r in value):
        value = ",".join(str(r) for r in value)
    elif not isinstance(value, str):
        raise GridError(f"{where}: 'only_ranks' is a rank, a list of ranks or a string such as \"0,32\", got {value!r}")
    from accel.sim.runtime import stand_in

    try:
        stand_in.plan(world_size, value, shapes_only=True)
    except ValueError as error:
        raise GridError(f"{where}: 'only_ranks' {value!r}: {error}") from None
    return value


def _args(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list) and all(isinstance(word, (str, int, float)) for word in value):
        return tuple(str(word) for word in value)
    raise GridError(f"{where}: 'args' is a list of the program's arguments (or one string), got {value!r}")


def _env(where: str, value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return tuple(sorted(value.items()))
    raise GridError(f"{where}: 'env' is a table of variable names to strings, got {value!r}")


# -- running one layout -------------------------------------------------------------------------


def program_argv(program: list[str]) -> list[str]:
    """What follows `accel launch`'s options for `program`: `-m MODULE ARGS` or `SCRIPT ARGS` (a leading
    `python` dropped, since the ranks run Python); ValueError when there is none."""
    words = program[1:] if program[:1] == ["--"] else list(program)
    if words and (re.fullmatch(r"python[\d.]*", os.path.basename(words[0])) or words[0] == sys.executable):
        words = words[1:]
    if not words or words == ["-m"]:
        raise ValueError("give the program after --, e.g. -- python -m torchtitan.train --job.config_file x.toml")
    return words


def launch_command(layout: Layout, args: argparse.Namespace, program: list[str], report: Path) -> list[str]:
    """The `accel launch` command line that runs `layout`."""
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--shapes_only"]
    command += ["--gpu", args.gpu, "--num_processes", str(layout.num_processes), "--timing_report", str(report)]
    if layout.only_ranks is not None:
        command += ["--only_ranks", layout.only_ranks]
    if args.network:
        command += ["--network", args.network]
    if args.gpus_per_node:
        command += ["--gpus_per_node", str(args.gpus_per_node)]
    if args.timeout:  # launch stops every rank of a run past it, and says so
        command += ["--timeout", f"{args.timeout:g}"]
    tokens = layout.tokens_per_step or args.tokens_per_step
    if tokens:
        command += ["--tokens_per_step", str(tokens)]
    return command + program + list(layout.args)


def run_layout(layout: Layout, args: argparse.Namespace, program: list[str], folder: Path) -> Outcome:
    """Run `layout` in a subprocess and read what it gave (its output is kept in `folder`)."""
    report = folder / f"{layout.name}.timing.json"
    command = launch_command(layout, args, program, report)
    env = {**os.environ, **dict(layout.env)}
    start = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output, code = done.stdout, done.returncode
    seconds = time.monotonic() - start
    (folder / f"{layout.name}.log").write_text(shlex.join(command) + "\n" + output)
    outcome = Outcome(layout, "fits", seconds, peak_gib=peak_reserved_gib(output))
    if code != 0 and OUT_OF_MEMORY.search(output):
        tried = _TRIED.findall(output)
        outcome.status, outcome.note = "does not fit", f"tried to allocate {tried[-1]}" if tried else ""
    elif code != 0 and args.timeout and _TIMED_OUT.search(output):
        outcome.status, outcome.note = "failed", f"timed out (--timeout {args.timeout:g} s)"
    elif code != 0:
        outcome.status, outcome.note = "failed", last_error(output)
    else:
        _add_figures(outcome, report, args)
    return outcome


def peak_reserved_gib(output: str) -> float | None:
    """The largest peak reserved, in GiB, of the end-of-run lines in `output` (None if there is none)."""
    peaks = [float(m[4]) * _UNIT[m[5]] for m in END_LINE.finditer(output)]
    return max(peaks) if peaks else None


def last_error(output: str) -> str:
    """The error's last line: the last line naming an exception, else the last line; rank prefix removed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _ERROR.match(line)
        if match:
            return match[1]
    return lines[-1] if lines else "no output"


def _add_figures(outcome: Outcome, report: Path, args: argparse.Namespace) -> None:
    """The predicted step, MFU and exposed communication of the timing report's ranks (the clock's own summary).

    The layout's step is its slowest rank's; MFU is the ranks' executed FLOPs (each rank run weighted by
    the ranks it stands for) over that step; the exposed share is the slowest rank's.
    """
    per_rank = _rank_summaries(report, args.gpu)
    if not per_rank:
        outcome.note = "no whole step timed (the clock needs two optimizer steps)"
        return
    layout = outcome.layout
    slowest = max(per_rank.values(), key=lambda figures: figures["time_s"])
    step = slowest["time_s"]
    weights = _weights(layout, list(per_rank))
    outcome.step_s = step
    outcome.mfu = sum(w * per_rank[r]["mfu"] * per_rank[r]["time_s"] for r, w in weights.items()) / step
    outcome.exposed_comm_share = slowest["exposed_comm_share"]
    tokens = layout.tokens_per_step or args.tokens_per_step
    if tokens:
        outcome.tokens_per_s_per_gpu = tokens / step / layout.num_processes


def _rank_summaries(report: Path, gpu: str) -> dict[int, dict[str, float]]:
    """Each rank's `accel.sim.cuda.timing.report.summary` of the steps the report holds."""
    if not report.exists():
        return {}
    from accel.sim.cuda.gpus import cards
    from accel.sim.cuda.timing import clock as clocks
    from accel.sim.cuda.timing import report as timing

    card = cards.resolve(gpu)
    summaries = {}
    for rank, data in json.loads(report.read_text()).get("ranks", {}).items():
        clock = clocks.Clock(card)
        clock.steps = [clocks.Step(**step) for step in data["steps"]]
        figures = timing.summary(clock, 1)
        if figures is not None and figures["time_s"] > 0:
            summaries[int(rank)] = figures
    return summaries


def _weights(layout: Layout, ranks: list[int]) -> dict[int, float]:
    """The share of the world each rank run stands for (1/len(ranks) each when every rank ran)."""
    if layout.only_ranks is None:
        return {rank: 1 / len(ranks) for rank in ranks}
    from accel.sim.runtime import stand_in

    plan = stand_in.plan(layout.num_processes, layout.only_ranks, shapes_only=True)
    counts = {rank: len(plan.stands_for(rank)) for rank in ranks if rank in plan.ranks}
    total = sum(counts.values())
    return {rank: count / total for rank, count in counts.items()}


# -- the table -------------------------------------------------------------------------------------


def ordered(outcomes: list[Outcome], by: str = "step") -> list[Outcome]:
    """Fastest first (shortest step, or with `by="throughput"` most tokens/s per GPU: layouts whose global
    batches differ); then layouts that fit without that figure, those that do not fit, those that failed."""
    rank = {"fits": 0, "does not fit": 1, "failed": 2}

    def key(outcome: Outcome) -> tuple[int, float]:
        if by == "throughput":
            tokens = outcome.tokens_per_s_per_gpu
            return (-1, -tokens) if tokens is not None else (rank[outcome.status], 0.0)
        return (-1, outcome.step_s) if outcome.step_s is not None else (rank[outcome.status], 0.0)

    return sorted(outcomes, key=key)


def _step_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def table(outcomes: list[Outcome], gpu: str, by: str = "step") -> str:
    """The layouts, fastest first, as plain aligned text."""
    header = ("layout", "GPUs", "fits", "peak GiB", "step", "tokens/s/GPU", "MFU", "exposed comm", "note")
    rows = [header]
    for o in ordered(outcomes, by):
        rows.append(
            (
                o.layout.name,
                str(o.layout.num_processes),
                {"fits": "yes", "does not fit": "no (OOM)", "failed": "failed"}[o.status],
                "-" if o.peak_gib is None else f"{o.peak_gib:.2f}",
                _step_text(o.step_s),
                "-" if o.tokens_per_s_per_gpu is None else f"{o.tokens_per_s_per_gpu:,.0f}",
                "-" if o.mfu is None else f"{o.mfu:.1%}",
                "-" if o.exposed_comm_share is None else f"{o.exposed_comm_share:.1%}",
                o.note if len(o.note) <= 100 else o.note[:97] + "...",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {1, 3, 4, 5, 6, 7}
    lines = [f"accel plan on {gpu} (predicted; shapes only):"]
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------------


def check(args: argparse.Namespace) -> tuple[list[Layout], list[str]]:
    """The layouts and the program's launch words, or ValueError (GridError) saying what to fix."""
    from accel.commands.launch import _check_timing_args
    from accel.sim.cuda.gpus import cards

    program = program_argv(args.program)
    cards.check(args.gpu)
    _check_timing_args(args)
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    return read_grid(args.grid), program


def _progress(text: str) -> None:
    print(f"accel plan: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the `plan` command: every layout, one after the other, then the table; the exit code."""
    try:
        layouts, program = check(args)
    except ValueError as error:
        print(f"accel plan: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="accel_plan_") as scratch:
        folder = Path(args.keep) if args.keep else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        outcomes = []
        for index, layout in enumerate(layouts, 1):
            which = f"only_ranks {layout.only_ranks}" if layout.only_ranks is not None else "every rank run"
            _progress(f"[{index}/{len(layouts)}] {layout.name} ({layout.num_processes} GPUs, {which}) ...")
            outcome = run_layout(layout, args, program, folder)
            outcomes.append(outcome)
            said = outcome.status if outcome.step_s is None else f"{outcome.status}, step {_step_text(outcome.step_s)}"
            _progress(f"[{index}/{len(layouts)}] {layout.name}: {said} ({outcome.seconds:.0f} s)")
    print(table(outcomes, args.gpu, args.sort), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([o.as_json() for o in ordered(outcomes, args.sort)], indent=1))
    return 0
