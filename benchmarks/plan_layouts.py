"""Pick the layout of Llama 3 70B on 64 H100s: `accel plan` over FSDP, HSDP and FSDP x TP layouts.

The program is torchtitan 0.2.2's own trainer (``python -m torchtitan.train``, unchanged) with its
``llama3_70b.toml`` preset (Llama 3 70B: flavour "70B", sequence 8192, local batch 8, tensor
parallelism 8 with FSDP2 over the other 8 ranks, full activation checkpointing, AdamW, bf16
parameters with fp32 gradient reduction), written out below with what this machine needs (as
``plan_published.py`` does for the 8B preset: a word-level tokenizer and a small text set made
here, the dump folder, 3 steps, metrics at every step, profiling and tensorboard off). Note: the
preset's activation checkpointing is "full", not per-op selective as the 8B preset's; two layouts
below try selective.

Each layout changes only torchtitan flags (parallel degrees, batch, checkpointing) and is run by
``accel plan`` on 64 simulated H100s, with ``--only_ranks 0``: in FSDP, HSDP and FSDP x TP every
rank does what rank 0 does (same shapes, collectives, memory). The layouts keep the preset's global
batch, 64 sequences of 8192 tokens, but ``fsdp8-tp8-b16`` (128) and the two ``-b2`` ones (16, where
selective checkpointing fits), so tokens/s per GPU compare alike.

Not in the grid: pipeline parallelism. A rank standing in for a pipeline stage cannot know the
shapes the previous stage sends it (`accel.sim.cuda.nccl.stand_in` stops such a run, naming the
receive), and running every one of 64 ranks takes about 25 GiB and a quarter of an hour of both
cores here (docs/planning.md, "Big worlds").

    python benchmarks/plan_layouts.py                       # every layout, about 10 minutes here
    python benchmarks/plan_layouts.py --layout fsdp8-tp8    # one (a dry run to gauge the time)
    python benchmarks/plan_layouts.py --list

The allocator setting is torchtitan's ``run_train.sh``'s (expandable segments). Values mean
nothing in these ``--shapes_only`` runs; shapes, memory and the predicted step do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plan_published import clean_env, workspace

SEQ = 8192
WORLD = 64


@dataclass(frozen=True)
class Layout:
    """A layout of the 64 GPUs, as torchtitan flags on top of llama3_70b.toml."""

    name: str
    what: str
    tp: int = 8
    replicate: int = 1
    local_batch: int = 8
    ac: str = "full"  # torchtitan's activation_checkpoint.mode; "selective" is per-op

    def args(self) -> list[str]:
        flags = ["--parallelism.tensor_parallel_degree", str(self.tp)]
        flags += ["--parallelism.data_parallel_replicate_degree", str(self.replicate)]
        flags += ["--training.local_batch_size", str(self.local_batch), "--activation_checkpoint.mode", self.ac]
        return flags + (["--activation_checkpoint.selective_ac_option", "op"] if self.ac == "selective" else [])

    def tokens_per_step(self) -> int:
        """Tokens of one step over all ranks: local batch x sequence x data-parallel ranks (64 / TP)."""
        return self.local_batch * SEQ * (WORLD // self.tp)


LAYOUTS: tuple[Layout, ...] = (
    Layout("fsdp8-tp8", "the preset: FSDP 8 x TP 8, local batch 8, full AC"),
    Layout("fsdp8-tp8-sac", "as the preset, per-op selective AC", ac="selective"),
    Layout("fsdp8-tp8-b2", "as the preset, local batch 2 (global batch / 4)", local_batch=2),
    Layout("fsdp8-tp8-b2-sac", "as fsdp8-tp8-b2, per-op selective AC", local_batch=2, ac="selective"),
    Layout("fsdp8-tp8-b16", "as the preset, local batch 16 (global batch doubled)", local_batch=16),
    Layout("fsdp16-tp4", "FSDP 16 x TP 4, local batch 4, full AC", tp=4, local_batch=4),
    Layout("fsdp64", "FSDP over all 64, local batch 1, full AC", tp=1, local_batch=1),
    Layout("hsdp2x32", "HSDP: 2 replicas of FSDP 32, local batch 1, full AC", tp=1, replicate=2, local_batch=1),
    Layout("hsdp8x8", "HSDP: 8 replicas of FSDP 8, local batch 1, full AC", tp=1, replicate=8, local_batch=1),
)


def config_70b(root: Path) -> str:
    """torchtitan 0.2.2's torchtitan/models/llama3/train_configs/llama3_70b.toml, with what this machine needs.

    Changed: the tokenizer and data (made here), the dump folder, the number of steps, metrics logged
    at every step, profiling and tensorboard off, the checkpoint and validation keys that do nothing
    when disabled left out; the rest as torchtitan has it.
    """
    return f"""
[job]
dump_folder = "{root / "outputs"}"
description = "Llama 3 70B training"

[profiling]
enable_profiling = false

[metrics]
log_freq = 1
enable_tensorboard = false
disable_color_printing = true

[model]
name = "llama3"
flavor = "70B"
hf_assets_path = "{root / "tokenizer"}"

[optimizer]
name = "AdamW"
lr = 1.5e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up, normally 20% of the train steps

[training]
local_batch_size = 8
seq_len = {SEQ}
max_norm = 1.0  # grad norm clipping
steps = 3
dataset = "c4_test"
dataset_path = "{root / "data"}"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8  # 8-way TP
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false

[activation_checkpoint]
mode = "full"

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
"""


def grid(layouts: list[Layout]) -> str:
    """The layouts as `accel plan`'s TOML grid (rank 0 standing in for all 64)."""
    tables = []
    for layout in layouts:
        tables.append(
            "[[layout]]\n"
            f"name = {json.dumps(layout.name)}\n"
            f"num_processes = {WORLD}\n"
            'only_ranks = "0"\n'
            f"args = {json.dumps(layout.args())}\n"
            f"tokens_per_step = {layout.tokens_per_step()}\n"
        )
    return "\n".join(tables)


def sweep(layouts: list[Layout], root: Path, steps: int) -> float:
    """Run `accel plan` over `layouts` in `root` (its progress and table shown as they come); the wall time."""
    toml = workspace(root, config_70b, "llama3_70b.toml")
    (root / "layouts.toml").write_text(grid(layouts))
    command = [sys.executable, "-m", "accel.commands.cli", "plan", "--grid", str(root / "layouts.toml")]
    command += ["--gpu", "H100", "--sort", "throughput"]  # global batches differ: most tokens/s per GPU first
    command += ["--keep", str(root / "runs"), "--json", str(root / "plan.json"), "--"]
    command += ["-m", "torchtitan.train", "--job.config_file", str(toml), "--training.steps", str(steps)]
    env = clean_env(root, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    start = time.monotonic()
    subprocess.run(command, env=env, cwd=root, check=True)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", action="append", help="run only these layouts (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the layouts")
    parser.add_argument("--keep", type=Path, default=None, help="work (and keep the logs) in this folder")
    parser.add_argument("--steps", type=int, default=3, help="torchtitan steps per layout (the clock times 2 of 3)")
    args = parser.parse_args()
    layouts = [layout for layout in LAYOUTS if not args.layout or layout.name in args.layout]
    if args.list or not layouts:
        for layout in LAYOUTS:
            print(f"{layout.name:16s} {layout.what}\n{'':16s} {' '.join(layout.args())}")
        return
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        seconds = sweep(layouts, args.keep.resolve(), args.steps)
    else:
        with tempfile.TemporaryDirectory(prefix="plan_layouts_") as tmp:
            seconds = sweep(layouts, Path(tmp), args.steps)
    print(f"\nLlama 3 70B (torchtitan 0.2.2 llama3_70b.toml), 64 H100s, {len(layouts)} layouts: {seconds:.0f} s wall")


if __name__ == "__main__":
    main()
