"""The simulator's per-GPU peak memory against published figures of real training runs.

Each case is a run that others measured on real GPUs and published with its configuration
(torchtitan's and torchao's benchmark tables, see ``CASES``). This program runs the same
configuration under the simulator, with torchtitan's own trainer (``python -m torchtitan.train``,
torchtitan 0.2.2, unchanged) on ``--shapes_only`` simulated GPUs of the card they used, under the
allocator setting their launcher set (torchtitan's ``run_train.sh``: expandable segments; the AWS
sample's: none), and prints the published figure, the simulated one and their ratio.

The figure compared is the one torchtitan logs, ``memory: X GiB(Y%)`` on each logged step: the
peak of ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]`` since the previous logged step
(torchtitan resets the peak at each log); the simulated figure is that line on the last step
(steady state: the optimizer's state exists), read from rank 0's output.

The configuration is torchtitan 0.2.2's ``llama3_8b.toml`` (Llama 3.1 8B: FSDP2 over all ranks,
bf16 parameters with fp32 gradient reduction, sequence 8192, per-op selective activation
checkpointing, AdamW) written out below, with each case's own flags. What the simulator needs
that the real runs read from disk is made here: a word-level tokenizer (the model keeps Llama
3's vocabulary of 128256 all the same: it is part of the flavour) and a small ``c4_test``-like
text set; values mean nothing in ``--shapes_only`` runs, shapes and memory do.

    python benchmarks/plan_published.py                 # every case, one after the other
    python benchmarks/plan_published.py --case eager-b2 # one case
    python benchmarks/plan_published.py --list

A case of 8 ranks takes one to five minutes of a 2-core machine, one of 32 or 128 ranks about 12
seconds: those run rank 0 only (``--only_ranks 0``), standing in for the others, FSDP making every
rank's step the same (on 8 ranks, ``--only_ranks 0`` gives the full run's figures to the byte);
all of them, one after the other, 15 to 20 minutes (on a machine shared with other work).
Nothing here is tuned to the figures: the simulator's constants come from how the card and the
allocator work, and where a figure differs README.md ("Checked against published runs") says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TITAN_BENCH = "https://github.com/pytorch/torchtitan/blob/{commit}/benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_BENCH_COMMIT = "31a17bfdb70bab6f62a13d21816a5339b911d6e3"
AO_FLOAT8_README = (
    "https://github.com/pytorch/ao/blob/8c81863ba85cce742244c0151c6683c5696bbe04/torchao/float8/README.md"
)
AO_TUTORIAL = (
    "https://github.com/pytorch/ao/blob/36027d82d1ad9949597ea16002ff4940374b1b94/"
    "docs/source/eager_tutorials/pretraining.rst"
)
AWS_README = (
    "https://github.com/awslabs/awsome-distributed-ai/blob/95b939cdc5b24ded03a70da21533964f9354b731/"
    "3.test_cases/pytorch/torchtitan/slurm/README.md"
)
FLOAT8_TENSORWISE = (
    "--model.converters",
    "quantize.linear.float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
)
#: the attention kernel of the published runs: their torchtitan called `F.scaled_dot_product_attention` with torch's
#: own order (9dec370's llama/model.py), and their torch (before 2.9) ran FlashAttention-2 on an H100 (cuDNN's was
#: not chosen: pytorch/pytorch#142132, Dec 2024, "expected"; torch 2.9 put cuDNN's first on sm_90,
#: pytorch/pytorch#162073). torchtitan 0.2.2 puts cuDNN's first itself (`ScaledDotProductAttentionWrapper`): by
#: default this program runs its trainer with torch's old order (`AS_PUBLISHED`); `--attention installed` leaves it
AS_PUBLISHED = """\
\"\"\"torchtitan's trainer, attention in the published runs' order (their torch and torchtitan: flash first).\"\"\"
import runpy

from torch.nn.attention import SDPBackend
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

ScaledDotProductAttentionWrapper.sdpa_backends = [
    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION
]
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
"""
#: torchtitan's flags for local batch 2, and for compiling the blocks only (not the loss)
BATCH_2 = ("--training.local_batch_size", "2")
COMPILED_BLOCKS = ("--compile.enable", "--compile.components", "model")
FLOAT8_ROWWISE = ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise")
#: Meta's Grand Teton H100s (96 GB HBM2e, 2.4 TB/s, 500 W): CUDA reports 95.0 GiB (torchtitan's logged
#: percentages: 30.89 GiB is 32.51%, 27.34 GiB is 28.78%); sm_90 and 132 SMs as the H100 SXM
H100_96GB = "H100-96GB"


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # where the figure is published (file at a commit)
    what: str  # the published configuration, in words
    published_gib: float  # torchtitan's "memory:" (max reserved), GiB
    gpu: str  # the card, as --gpu takes it
    ranks: int
    published_tps: float | None = None  # torchtitan's tokens per second per GPU ("tps"), where published
    flags: tuple[str, ...] = ()  # torchtitan flags on top of llama3_8b.toml (v0.2.2)
    steps: int = 3
    only_ranks: str | None = None  # --only_ranks: ranks run, each standing in for those its layout makes identical
    env: dict[str, str] = field(default_factory=lambda: {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    note: str = ""


CASES: tuple[Case, ...] = (
    Case(
        name="eager-b2",
        source=TITAN_BENCH.format(commit=TITAN_BENCH_COMMIT) + " (Table 1, row FSDP)",
        what="Llama 3.1 8B, 8 GPUs FSDP, local batch 2, seq 8192, per-op SAC, bf16/fp32-reduce, eager",
        published_gib=82.4,
        published_tps=5762,
        gpu=H100_96GB,
        ranks=8,
        flags=BATCH_2,
        note="torchtitan 9dec370, torch 1963fc8 (Dec 2024); its run_llama_train.sh sets"
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    Case(
        name="compile-b2",
        source=TITAN_BENCH.format(commit=TITAN_BENCH_COMMIT) + " (Table 1, row FSDP + torch.compile)",
        what="as eager-b2, each transformer block compiled (the loss was not compiled then)",
        published_gib=77.0,
        published_tps=6667,
        gpu=H100_96GB,
        ranks=8,
        flags=(*BATCH_2, *COMPILED_BLOCKS),
        note="torchtitan 9dec370 compiled the blocks, not the loss (turned off on 2024-12-18, e8977b0)",
    ),
    Case(
        name="eager-b2-128",
        source=TITAN_BENCH.format(commit=TITAN_BENCH_COMMIT) + " (Table 3, row FSDP)",
        what="as eager-b2 on 128 GPUs (FSDP 128); rank 0 run, standing in for all 128",
        published_gib=67.0,
        published_tps=5605,
        gpu=H100_96GB,
        ranks=128,
        flags=BATCH_2,
        only_ranks="0",
    ),
    Case(
        name="compile-b2-128",
        source=TITAN_BENCH.format(commit=TITAN_BENCH_COMMIT) + " (Table 3, row FSDP + torch.compile)",
        what="as compile-b2 on 128 GPUs (FSDP 128); rank 0 run, standing in for all 128",
        published_gib=62.0,
        published_tps=6514,
        gpu=H100_96GB,
        ranks=128,
        flags=(*BATCH_2, *COMPILED_BLOCKS),
        only_ranks="0",
    ),
    Case(
        name="compile-b2-f8",
        source=TITAN_BENCH.format(commit=TITAN_BENCH_COMMIT) + " (Table 1, row FSDP + torch.compile + Float8)",
        what="as compile-b2, float8 tensorwise Linears (not the output), FSDP gathering float8 weights",
        published_gib=76.8,
        published_tps=8532,
        gpu=H100_96GB,
        ranks=8,
        flags=(*BATCH_2, *COMPILED_BLOCKS, *FLOAT8_TENSORWISE),
        note="torchtitan 9dec370: --float8.enable_float8_linear --float8.enable_fsdp_float8_all_gather"
        " --float8.precompute_float8_dynamic_scale_for_fsdp (tensorwise scaling)",
    ),
    Case(
        name="compile-b2-f8-128",
        source=TITAN_BENCH.format(commit=TITAN_BENCH_COMMIT) + " (Table 3, row FSDP + torch.compile + Float8)",
        what="as compile-b2-f8 on 128 GPUs (FSDP 128); rank 0 run, standing in for all 128",
        published_gib=61.8,
        published_tps=8380,
        gpu=H100_96GB,
        ranks=128,
        flags=(*BATCH_2, *COMPILED_BLOCKS, *FLOAT8_TENSORWISE),
        only_ranks="0",
    ),
    Case(
        name="compile-b1",
        source=AO_FLOAT8_README + " (bfloat16 row)",
        what="Llama 3 8B, 8 H100 FSDP, local batch 1, seq 8192, per-op SAC, bf16/fp32-reduce, blocks compiled",
        published_gib=47.65,
        gpu=H100_96GB,
        ranks=8,
        flags=COMPILED_BLOCKS,
        note="torch 2.7.0a0+gitb98af95, torchao 890e0ac8 (2025-02-28), torchtitan of early March 2025: loss not"
        " compiled; the table's 'GB' are torchtitan's GiB (parse_torchtitan_logs.py reads 'memory: X GiB');"
        " card not stated",
    ),
    Case(
        name="compile-b1-f8tw",
        source=AO_FLOAT8_README + " (tensorwise with float8 all-gather row)",
        what="as compile-b1, float8 tensorwise Linears (not the output), FSDP gathering float8 weights",
        published_gib=47.77,
        gpu=H100_96GB,
        ranks=8,
        flags=(*COMPILED_BLOCKS, *FLOAT8_TENSORWISE),
        note="float8_training_benchmark.sh: --float8.enable_fsdp_float8_all_gather"
        " --float8.precompute_float8_dynamic_scale_for_fsdp --float8.force_recompute_fp8_weight_in_bwd"
        " (the last is torchao 0.17's behaviour, its flag deprecated)",
    ),
    Case(
        name="compile-b1-f8rw",
        source=AO_FLOAT8_README + " (rowwise with bfloat16 all-gather row)",
        what="as compile-b1, float8 rowwise Linears (not the output), FSDP gathering bf16 weights",
        published_gib=47.79,
        gpu=H100_96GB,
        ranks=8,
        flags=(*COMPILED_BLOCKS, *FLOAT8_ROWWISE),
    ),
    Case(
        name="compile-b1-loss",
        source=AO_TUTORIAL + " (bfloat16 baseline log, step 10-40)",
        what="as compile-b1, the loss compiled too (torchtitan 775a486, 2025-06-04)",
        published_gib=30.89,
        gpu=H100_96GB,
        ranks=8,
        flags=("--compile.enable",),
        note="95.0 GiB card (30.89 GiB is 32.51%); compile of the loss re-enabled on 2025-04-02 (bbb1b61)",
    ),
    Case(
        name="eager-b1-32",
        source=AWS_README + " (Performance Numbers, step 1990)",
        what="Llama 3.1 8B, 32 H100 80GB (4 p5.48xlarge) FSDP, local batch 1, seq 8192, per-op SAC, eager,"
        " default allocator",
        published_gib=68.57,
        gpu="H100",
        ranks=32,
        env={},
        only_ranks="0",
        note="torchtitan main of early March 2025 (llama3_8b.toml defaults), torch nightly cu124; launched by"
        " srun + torchrun without PYTORCH_CUDA_ALLOC_CONF: fixed segments",
    ),
)


def tokenizer(folder: Path) -> None:
    """A word-level tokenizer with Llama 3's BOS and EOS, as torchtitan's HF tokenizer loader reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(1000)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2} | {w: i + 3 for i, w in enumerate(words)}
    made = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    made.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def dataset(folder: Path, documents: int = 64, words: int = 20000) -> None:
    """A `c4_test`-like set (json lines {"text": ...}); torchtitan packs documents into samples and loops over it."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for d in range(documents):
        text = " ".join(f"w{(d * 7 + 3 * i) % 1000}" for i in range(words))
        lines.append(json.dumps({"text": text}) + "\n")
    (folder / "data.json").write_text("".join(lines))


def config(root: Path) -> str:
    """torchtitan 0.2.2's torchtitan/models/llama3/train_configs/llama3_8b.toml, with what this machine needs.

    Changed: the tokenizer and data (made here), the dump folder, the number of steps, metrics logged
    at every step, profiling and tensorboard off (neither touches GPU memory); the rest as torchtitan
    has it.
    """
    return f"""
[job]
dump_folder = "{root / "outputs"}"
description = "Llama 3 8B training"

[profiling]
enable_profiling = false

[metrics]
log_freq = 1
enable_tensorboard = false
disable_color_printing = true

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "{root / "tokenizer"}"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 3
dataset = "c4_test"
dataset_path = "{root / "data"}"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false

[compile]
enable=false
components = ["model", "loss"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
"""


def workspace(root: Path, toml: Callable[[Path], str] = config, name: str = "llama3_8b.toml") -> Path:
    """Tokenizer, data and torchtitan toml (`toml(root)`, 8B's by default) under `root`; the toml's path."""
    tokenizer(root / "tokenizer")
    dataset(root / "data")
    path = root / name
    path.write_text(toml(root))
    return path


def clean_env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without launcher or simulator settings, plus `extra` and offline HF caches."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "CUDA_", "PYTORCH_"))
    }
    env.update(extra, HF_HOME=str(root / "hf"), HF_DATASETS_OFFLINE="1")
    return env


STEP_LINE = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB\(([\d.]+)%\)")
END_LINE = re.compile(r"\[rank 0\] accel\.sim: cuda:0 .*?peak allocated ([\d.]+) GiB, peak reserved ([\d.]+) GiB")


def run(case: Case, root: Path, extra: tuple[str, ...] = (), attention: str = "published") -> dict:
    """Launch torchtitan's trainer for `case` on simulated GPUs: rank 0's logged memory per step, accel's end line.
    `attention`: "published" (the published runs' kernel order, `AS_PUBLISHED`) or "installed" (torchtitan's own)."""
    toml = workspace(root)
    trainer = ["-m", "torchtitan.train"]
    if attention == "published":
        (root / "train_as_published.py").write_text(AS_PUBLISHED)
        trainer = [str(root / "train_as_published.py")]
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda", "--shapes_only"]
    command += ["--gpu", case.gpu, "--num_processes", str(case.ranks), "--local_ranks_filter", "0", *extra]
    command += ["--timing_report", str(root / "timing.json")]
    if case.only_ranks:
        command += ["--only_ranks", case.only_ranks]
    command += [*trainer, "--job.config_file", str(toml), "--training.steps", str(case.steps)]
    command += list(case.flags)
    env = clean_env(root, case.env)
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    (root / f"{case.name}.log").write_text(output)
    steps = {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(output)}
    end = END_LINE.search(output)
    result = {
        "case": case.name,
        "returncode": done.returncode,
        "seconds": round(seconds, 1),
        "steps": steps,
        "simulated_gib": steps[max(steps)] if steps else None,
        "run_peak_allocated_gib": float(end[1]) if end else None,
        "run_peak_reserved_gib": float(end[2]) if end else None,
        "out_of_memory": "CUDA out of memory" in output,
        "command": " ".join(command),
        "env": case.env,
    }
    result.update(_predicted(case, root / "timing.json"))
    if done.returncode != 0 or not steps:
        result["tail"] = output[-3000:]
    return result


def _tokens_per_gpu(case: Case) -> int:
    """Tokens one GPU's step holds: torchtitan's local batch (1 unless the case's flags say) x sequence 8192."""
    flags = list(case.flags)
    batch = int(flags[flags.index("--training.local_batch_size") + 1]) if "--training.local_batch_size" in flags else 1
    return batch * 8192


def _predicted(case: Case, report: Path) -> dict:
    """Rank 0's predicted step (median over the steps the clock saw) and tokens/s per GPU, from the timing report."""
    if not report.exists():
        return {"predicted_step_s": None, "predicted_tps": None}
    steps = json.loads(report.read_text())["ranks"]["0"]["steps"]
    if not steps:
        return {"predicted_step_s": None, "predicted_tps": None}
    times = sorted(step["time_s"] for step in steps)
    median = times[len(times) // 2]
    exposed = sorted(step["exposed_comm_s"] for step in steps)[len(times) // 2]
    return {
        "predicted_step_s": median,
        "predicted_tps": _tokens_per_gpu(case) / median,
        "predicted_exposed_comm_s": exposed,
    }


def report(root: Path, wanted: bool, trace: bool = False) -> tuple[str, ...]:
    memory = ("--memory_report", str(root / "memory.html")) if wanted else ()
    return memory + (("--timing_trace", str(root / "trace.json")) if trace else ())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the cases and their sources")
    parser.add_argument("--out", type=Path, default=None, help="write the results as json here")
    parser.add_argument("--keep", type=Path, default=None, help="work (and keep the logs) in this folder")
    parser.add_argument("--only_ranks", default=None, help="run every case with this --only_ranks (a check)")
    parser.add_argument(
        "--attention",
        choices=("published", "installed"),
        default="published",
        help="attention kernels in the published runs' order (flash first, default) or installed torchtitan's (cuDNN)",
    )
    parser.add_argument("--memory_report", action="store_true", help="also print what made up rank 0's peak (slower)")
    parser.add_argument(
        "--trace", action="store_true", help="also write rank 0's last step as trace.json (with --keep)"
    )
    args = parser.parse_args()
    cases = [c for c in CASES if not args.case or c.name in args.case]
    if args.only_ranks:
        cases = [dataclasses.replace(c, only_ranks=args.only_ranks) for c in cases]
    if args.list:
        for case in cases:
            print(f"{case.name}: {case.what}; published {case.published_gib} GiB\n  {case.source}\n  {case.note}")
        return
    results = []
    for case in cases:
        if args.keep:
            root = args.keep / case.name
            root.mkdir(parents=True, exist_ok=True)
            result = run(case, root, report(root, args.memory_report, args.trace), args.attention)
        else:
            with tempfile.TemporaryDirectory(prefix="plan_published_") as tmp:
                result = run(case, Path(tmp), report(Path(tmp), args.memory_report, args.trace), args.attention)
        result["published_gib"] = case.published_gib
        results.append(result)
        sim = result["simulated_gib"]
        ratio = f"{sim / case.published_gib:.3f}" if sim else "-"
        print(
            f"{case.name:16s} published {case.published_gib:6.2f} GiB  simulated "
            f"{sim if sim is not None else float('nan'):6.2f} GiB  ratio {ratio}  "
            f"({result['seconds']:.0f} s; steps {result['steps']})",
            flush=True,
        )
        if "tail" in result:
            print(result["tail"], flush=True)
    print(f"\n{'case':16s} {'GPUs':>5s} {'published':>10s} {'simulated':>10s} {'error':>7s}")
    for case, result in zip(cases, results, strict=True):
        sim = result["simulated_gib"]
        error = f"{100 * (sim / case.published_gib - 1):+6.1f}%" if sim else "-"
        print(f"{case.name:16s} {case.ranks:5d} {case.published_gib:10.2f} {sim or float('nan'):10.2f} {error:>7s}")
    timed = [(c, r) for c, r in zip(cases, results, strict=True) if c.published_tps and r["predicted_tps"]]
    if timed:
        header = f"{'case':16s} {'GPUs':>5s} {'published tps':>14s} {'predicted tps':>14s} {'error':>7s}"
        print(f"\n{header}  step (exposed comm)")
        for case, result in timed:
            predicted = result["predicted_tps"]
            error = f"{100 * (predicted / case.published_tps - 1):+6.1f}%"
            print(
                f"{case.name:16s} {case.ranks:5d} {case.published_tps:14,.0f} {predicted:14,.0f} {error:>7s}  "
                f"{result['predicted_step_s']:.3f} s ({result['predicted_exposed_comm_s']:.3f} s)"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
