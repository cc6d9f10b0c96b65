"""Benchmark: what a shapes-only step of a Llama-3-70B-shaped model under FSDP x TP costs this machine, by world size.

The program is `tests/programs/plan_llama.py`: torchtitan 0.2.2's Llama 3 with 70B's shapes (hidden
8192, 80 layers, 64 heads, 8 key/value heads, feed-forward 28672, vocabulary 128256), parallelised by
torchtitan's `parallelize_llama` (tensor parallelism of degree 8 with loss parallelism, full
activation checkpointing, FSDP2 over the rest of the world, bf16 parameters, fp32 reduction), one
step of AdamW at sequence 8192, local batch 1, on simulated H100s:

    accel launch --simulate cuda --shapes_only --num_processes W [--only_ranks 0,W-1] plan_llama.py

For each world size W (`--sizes`, default 8 16 32 64 128), one after another, in one run:

* **stand-in**: `--only_ranks 0,W-1`: two processes, rank 0 standing in for ranks 0..W-2 and rank
  W-1 for itself (`accel.sim.runtime.stand_in`);
* **all**: one process per rank (the plain launch), for W up to `--all_up_to` (default 8);
* **all (estimated)**, after each stand-in row: not a measurement, marked so: the launcher's share
  plus W times one rank's CPU time (as the ranks report it) and largest process PSS, from that
  stand-in run (a rank standing in does the work of any rank of the full run); wall as that CPU
  time spread perfectly over this machine's cores. Where "all" was measured too, the two rows
  show how far the estimate is off.

Measured, per run, of the whole `accel launch` command as a user waits for it (fork server start,
torch and torchtitan imports in the ranks, building and sharding the model, the step, the
end-of-run report):

* **wall**: seconds from its start to its exit. The machine may be shared: each row gives the
  load average (1 minute) at its end, and CPU time is given too (on shared, hyperthreaded cores
  a busy machine makes CPU time grow as well, less than wall time);
* **cpu**: user + system seconds summed over its process tree, read from /proc every
  `--interval` seconds (each process counted at its last reading: under by up to one interval each);
* **host peak**: the largest total, over the samples, of the tree's PSS (proportional set size:
  a page n processes share counts 1/n, so the sum is the memory the run takes from the machine)
  and of its RSS (each process's resident pages, shared ones counted in each: what `ps` adds up);
* **GPU peak**: rank 0's peak allocated and reserved memory as the simulator counts it (whole run),
  or "out of memory" where the step does not fit the card (70B with AdamW needs at least 16 bytes
  a parameter: more than 8 H100s hold).

    python benchmarks/bench_plan_scale.py [--sizes 8 16 32 64 128] [--all_up_to 8] [--layers 80]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = Path(__file__).resolve().parents[1] / "tests" / "programs" / "plan_llama.py"
ACCEL = str(Path(sys.executable).with_name("accel"))
GiB = 2**30


@dataclasses.dataclass
class Run:
    """What one `accel launch` cost, and what its ranks reported."""

    world: int
    mode: str
    ranks: int
    wall: float
    cpu: float
    pss: int
    rss: int
    #: the largest peak PSS of one process of the tree (a rank)
    rank_pss: int
    exit_code: int
    records: list[dict]
    out_of_memory: bool
    #: the machine's load average (1 minute) when the run ended: others' work shares the cores
    load: float = 0.0


def _tree(root: int) -> list[int]:
    """`root` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, index = [root], 0
    while index < len(found):
        found += children.get(found[index], [])
        index += 1
    return found


def _reading(pid: int) -> tuple[int, int, float] | None:
    """(PSS bytes, RSS bytes, CPU seconds) of process `pid`, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        sizes = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("Pss", "Rss"):
                sizes[name] = int(rest.split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return sizes.get("Pss", 0), sizes.get("Rss", 0), (int(fields[11]) + int(fields[12])) / ticks


def measure(command: list[str], interval: float, log: Path) -> tuple[int, float, float, int, int, int]:
    """Run `command`, sampling its process tree; (exit code, wall, cpu, peak PSS, peak RSS, largest process PSS)."""
    started = time.monotonic()
    with open(log, "w") as output:
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        cpu: dict[int, float] = {}
        peak_pss = peak_rss = one_pss = 0
        while proc.poll() is None:
            pss = rss = 0
            for pid in _tree(proc.pid):
                reading = _reading(pid)
                if reading is not None:
                    pss, rss, cpu[pid] = pss + reading[0], rss + reading[1], reading[2]
                    one_pss = max(one_pss, reading[0])
            peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
            time.sleep(interval)
    return proc.returncode, time.monotonic() - started, sum(cpu.values()), peak_pss, peak_rss, one_pss


def launch(world: int, stand_in: bool, args: argparse.Namespace, folder: Path) -> Run:
    """One `accel launch` of the program on `world` simulated GPUs (ranks 0 and world-1 only if `stand_in`)."""
    out = folder / f"{world}-{'stand-in' if stand_in else 'all'}"
    command = [ACCEL, "launch", "--simulate", "cuda", "--shapes_only", "--num_processes", str(world)]
    command += ["--gpu", args.gpu, "--local_ranks_filter", f"0,{world - 1}"]
    if stand_in:
        command += ["--only_ranks", f"0,{world - 1}"]
    command += [str(PROGRAM), "--tp_degree", str(args.tp), "--layers", str(args.layers), "--out", str(out)]
    command += ["--seq_len", str(args.seq_len), "--local_batch", str(args.local_batch), "--ac", args.ac]
    log = folder / f"{out.name}.log"
    code, wall, cpu, pss, rss, one = measure(command, args.interval, log)
    records = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    text = log.read_text(errors="replace")
    if code != 0 and "CUDA out of memory" not in text:
        print(text[-6000:], file=sys.stderr)
        raise SystemExit(f"the run of {world} ranks ({'stand-in' if stand_in else 'all'}) failed; its log: {log}")
    ranks = 2 if stand_in and world > 1 else world
    mode = "stand-in" if stand_in else "all"
    return Run(world, mode, ranks, wall, cpu, pss, rss, one, code, records, code != 0, os.getloadavg()[0])


def _gpu(run: Run) -> str:
    rank0 = next((r for r in run.records if r["rank"] == 0), None)
    if run.out_of_memory or rank0 is None:
        return "out of memory"
    return f"{rank0['peak_allocated'] / GiB:6.2f} / {rank0['peak_reserved'] / GiB:6.2f}"


def _estimate(run: Run, cores: int, layout: str) -> str:
    """The row of one process per rank, estimated from a stand-in run: a rank standing in does what any rank of
    the full run does, so the full run costs the launcher's share plus `world` times a rank's (on `cores` cores)."""
    # a rank's own CPU time, as it reported it (a run that ran out of memory reports none: the tree's share)
    rank_cpu = [record["cpu_seconds"] for record in run.records] or [run.cpu / run.ranks] * run.ranks
    cpu = run.cpu - sum(rank_cpu) + run.world * sum(rank_cpu) / len(rank_cpu)
    pss = run.pss + (run.world - run.ranks) * run.rank_pss
    return (
        f"{run.world:5d}  {layout:<16}{'all (estimated)':<17}{run.world:9d}  {cpu / cores:7.0f}  {cpu:7.0f}  "
        f"{pss / GiB:10.2f} GiB  {'':>8}  (not run: {run.world} x a rank's cpu and PSS, on {cores} cores)"
    )


def table(runs: list[Run], cores: int, tp: int) -> list[str]:
    """The printed table: measured rows, and the estimated one-process-per-rank rows beyond --all_up_to."""
    lines = [
        f"{'world':>5}  {'layout':<16}{'mode':<17}{'processes':>9}  {'wall s':>7}  {'cpu s':>7}  "
        f"{'host peak PSS':>13}  {'RSS sum':>8}  GPU peak alloc / reserved GiB (rank 0); load average",
    ]
    for run in runs:
        layout = f"fsdp {max(run.world // tp, 1)} x tp {tp}"
        lines.append(
            f"{run.world:5d}  {layout:<16}{run.mode:<17}{run.ranks:9d}  {run.wall:7.0f}  {run.cpu:7.0f}  "
            f"{run.pss / GiB:10.2f} GiB  {run.rss / GiB:4.2f} GiB  {_gpu(run)}; load {run.load:.1f}"
        )
        if run.mode == "stand-in":  # also where one process per rank was measured: how good the estimate is
            lines.append(_estimate(run, cores, layout))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--all_up_to", type=int, default=8, help="run one process per rank up to this world size")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--local_batch", type=int, default=1)
    parser.add_argument("--ac", default="full")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples of the process tree")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(
        f"plan_llama.py, 70B shapes ({args.layers} layers), tp {args.tp}, sequence {args.seq_len}, batch "
        f"{args.local_batch}, AC {args.ac}, {args.gpu}; {cores} cores; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-scale-") as folder:
        for world in args.sizes:
            for stand_in in (False, True) if world <= args.all_up_to else (True,):
                run = launch(world, stand_in, args, Path(folder))
                runs.append(run)
                print(
                    f"  {world} ranks, {run.mode}: {run.wall:.0f} s, cpu {run.cpu:.0f} s, "
                    f"PSS {run.pss / GiB:.2f} GiB, GPU {_gpu(run)}",
                    flush=True,
                )
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}\n")
    print("\n".join(table(runs, cores, args.tp)))


if __name__ == "__main__":
    main()
