"""torchtitan's debug model, trained by torchtitan's own trainer, unchanged, on simulated GPUs.

torchtitan 0.2.2's trainer (`torchtitan.train`) is launched as its users launch it on a GPU
node (`accel launch --simulate cuda`, as they would run `torchrun`), configured by a toml and
command-line flags: llama3's "debugmodel" flavour, fp32 parameters, 4 steps of AdamW. Its
parallelisms are each run on 2 simulated GPUs: FSDP (`data_parallel_shard_degree`), tensor
parallelism, pipeline parallelism (Interleaved1F1B), `--compile.enable` (with FSDP, with tensor
parallelism), and float8 training emulated by torchao (FSDP gathering float8 weights); FSDP
with tensor parallelism on 4.

Everything torchtitan reads is made here: a word-level tokenizer (the `tokenizers` library)
and text files laid out as its `c4_test` set. Every run starts from one seed checkpoint,
torchtitan's way of comparing parallelisms: the 1-GPU reference run (local batch 2) saves
its initial weights as `--checkpoint.create_seed_checkpoint` would, and each other run loads
them (`--checkpoint.initial_load_path`). Each document is one sample (exactly `seq_len + 1`
tokens), so each run sees the reference's samples in each step: the data-parallel runs
(local batch 1 on each of 2 ranks) read a file whose first half is the reference's even
samples, as torchtitan splits a data set between ranks in contiguous halves. In fp32 every
run must then give the reference's losses, its gradient norms and its trained weights, to
float tolerance (sums are taken in another order; the gradient norm most, a float32 sum over
the 2048x256 elements of the output layer's gradient on the CPU's kernels: 1e-4 apart between
a sharded and an unsharded layer).

Each launch runs this very file as the rank program (`__main__` below): it runs
torchtitan's `main` with a `Trainer` that, after training, writes what the checks read
(the losses and gradient norms torchtitan logs, a checksum of each trained weight, the
devices of the parameters) to `$TITAN_OUT/rank<k>.json`.
"""

import functools
import importlib.util
import itertools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (pip install -e '.[test]' installs torchtitan==0.2.2)",
    ),
]

STEPS = 4
SEQ_LEN = 64
WORDS = [f"w{i}" for i in range(200)]
#: one 1-GPU step takes samples 2s and 2s+1 of the reference file
REF_TOKENS_PER_STEP = 2 * SEQ_LEN


# -- what torchtitan reads ------------------------------------------------------------------------


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer (one token a word) with Llama's BOS and EOS, as torchtitan's HF loader reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def documents(count: int, rng: random.Random) -> list[str]:
    """Documents of `SEQ_LEN - 1` words (with BOS and EOS: one sample each), counting up by 3 from a random word."""
    starts = [rng.randrange(len(WORDS)) for _ in range(count)]
    return [" ".join(WORDS[(start + 3 * i) % len(WORDS)] for i in range(SEQ_LEN - 1)) for start in starts]


def write_dataset(folder: Path, texts: list[str]) -> None:
    """`texts` as a `c4_test`-like set: one json line `{"text": ...}` each, read by `--training.dataset_path`."""
    folder.mkdir(parents=True)
    (folder / "data.json").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


def config(tokenizer: Path) -> str:
    """The toml torchtitan reads (`--job.config_file`), after its debug config; each run adds its flags."""
    return f"""
[job]
description = "llama3 debug model on simulated GPUs"
[metrics]
log_freq = 1
disable_color_printing = true
[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{tokenizer}"
[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 2
[training]
local_batch_size = 2
seq_len = {SEQ_LEN}
max_norm = 1.0
steps = {STEPS}
dataset = "c4_test"
mixed_precision_param = "float32"
[parallelism]
data_parallel_shard_degree = 1
[activation_checkpoint]
mode = "none"
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The tokenizer, the data sets and the config."""
    root = tmp_path_factory.mktemp("torchtitan")
    write_tokenizer(root / "tokenizer")
    rng = random.Random(0)
    evens, odds = documents(STEPS + 1, rng), documents(STEPS + 1, rng)
    write_dataset(root / "one_rank", [text for pair in zip(evens, odds, strict=True) for text in pair])
    write_dataset(root / "two_ranks", evens + odds)  # rank 0 reads the first half, rank 1 the second
    (root / "config.toml").write_text(config(root / "tokenizer"))
    return root


def launch(root: Path, out: Path, processes: int, *flags: str) -> str:
    """Launch torchtitan's trainer (this file's `run_rank`) with `flags` on `processes` simulated GPUs; its output."""
    command = [sys.executable, "-m", "accel.commands.cli", "launch", "--simulate", "cuda"]
    command += ["--num_processes", str(processes), __file__, "--job.config_file", str(root / "config.toml")]
    command += ["--job.dump_folder", str(out / "dump"), "--training.dataset_path", str(root / "one_rank"), *flags]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "CUDA_"))
    }
    env.update(TITAN_OUT=str(out), HF_HOME=str(root / "hf"), HF_DATASETS_OFFLINE="1")
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=out, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    assert "simcuda" not in output and "privateuse" not in output.lower(), output[-8000:]
    return output


def records(out: Path, processes: int) -> list[dict]:
    """What each rank of a run wrote (`run_rank`), checked for what every run must show."""
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]
    for rank, record in enumerate(ranks):
        assert record["devices"] == [f"cuda:{rank}"]  # rank k trains on cuda:k
        assert [step for step, _, _ in record["steps"]] == list(range(1, STEPS + 1))
        assert all(math.isfinite(value) for step in record["steps"] for value in step[1:])
    return ranks


@pytest.fixture(scope="module")
def reference(workspace):
    """The 1-GPU run (local batch 2, samples 2s and 2s+1 in step s), which first saves the seed checkpoint."""
    out = workspace / "reference"
    launch(workspace, out, 1, "--checkpoint.enable")
    assert (out / "dump" / "checkpoint" / "step-0" / ".metadata").exists()
    (one,) = records(out, 1)
    losses = [loss for _, loss, _ in one["steps"]]
    assert losses[-1] < losses[0] - 0.3  # it learns
    return one


@pytest.fixture(scope="module")
def train(workspace, reference):
    """`train(processes, *flags)`: each rank's record of a run from the reference's seed checkpoint, each run once."""

    runs = itertools.count()

    @functools.cache
    def run(processes: int, *flags: str) -> list[dict]:
        out = workspace / "runs" / str(next(runs))
        seed = str(workspace / "reference" / "dump" / "checkpoint" / "step-0")
        loading = ("--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path", seed)
        launch(workspace, out, processes, *loading, *flags)
        return records(out, processes)

    return run


TWO_RANKS_OF_DATA = ("--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2")


def two_ranks_of_data(workspace) -> tuple[str, ...]:
    return (*TWO_RANKS_OF_DATA, "--training.dataset_path", str(workspace / "two_ranks"))


def losses(record: dict) -> list[float]:
    return [loss for _, loss, _ in record["steps"]]


def grad_norms(record: dict) -> list[float]:
    return [norm for _, _, norm in record["steps"]]


def assert_trains_as(record: dict, reference: dict) -> None:
    """The reference's losses, gradient norms and trained weights, to float tolerance."""
    assert losses(record) == pytest.approx(losses(reference), abs=1e-4)
    assert grad_norms(record) == pytest.approx(grad_norms(reference), rel=1e-3)
    assert_weights_as(record["weights"], reference["weights"])


def assert_weights_as(weights: dict, reference: dict) -> None:
    for name, (total, squares, size) in weights.items():
        ref_total, ref_squares, ref_size = reference[name]
        assert size == ref_size, name
        assert squares == pytest.approx(ref_squares, rel=1e-5), name
        assert abs(total - ref_total) <= 1e-5 * math.sqrt(size * ref_squares), name  # |sum| <= sqrt(n * sum of squares)


def assert_ranks_agree(ranks: list[dict]) -> None:
    """Every rank logged rank 0's losses and holds its trained weights (whole, gathered from the shards)."""
    for record in ranks[1:]:
        assert record["steps"] == ranks[0]["steps"] and record["weights"] == ranks[0]["weights"]


# -- the runs --------------------------------------------------------------------------------------


def test_fsdp_on_two_gpus_trains_as_one_gpu(train, workspace, reference):
    ranks = train(2, *two_ranks_of_data(workspace))
    assert_ranks_agree(ranks)
    assert_trains_as(ranks[0], reference)
    assert ranks[0]["sharded"] == ["Shard(dim=0)"]  # FSDP2: every parameter a DTensor sharded over the 2 ranks
    assert ranks[0]["mesh_dims"] == [1]


def test_memory_snapshots_torchtitan_dumps_read_in_torchs_viewer(train, workspace, reference):
    import pickle

    from torch.cuda import _memory_viz

    snapshots = ("--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2")
    ranks = train(2, *two_ranks_of_data(workspace), *snapshots, "--profiling.save_memory_snapshot_folder", "mem")
    assert_trains_as(ranks[0], reference)  # recording changes nothing of the run
    for rank in range(2):
        (path,) = workspace.glob(f"runs/*/dump/mem/iteration_2/rank{rank}_memory_snapshot.pickle")
        snapshot = pickle.loads(path.read_bytes())
        trace = snapshot["device_traces"][rank]  # rank k's GPU is cuda:k of the two the process sees
        assert not any(snapshot["device_traces"][1 - rank])
        allocs = [e for e in trace if e["action"] == "alloc"]
        # steps 1 and 2 recorded from the trainer's start: its model's blocks, FSDP's all-gathers and the optimizer's
        files = {frame["filename"].split("torchtitan/")[-1] for e in allocs for frame in e["frames"]}
        assert {"models/llama3/model/model.py", "train.py"} & files, sorted(files)[:20]
        assert any("fsdp" in name for name in files) and any("optim" in name for name in files)
        live = {}
        for entry in trace:
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry["size"]
            elif entry["action"] == "free_completed":
                live.pop(entry["addr"], None)
        held = sum(
            b["requested_size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
        )
        assert sum(live.values()) <= held  # what the trace leaves allocated is held (the rest came before it began)
        assert "total_allocated" in _memory_viz.segsum(snapshot) and "MemoryViz" in _memory_viz.trace_plot(snapshot)


def test_tensor_parallel_on_two_gpus_trains_as_one_gpu(train, reference):
    ranks = train(2, "--parallelism.tensor_parallel_degree", "2")
    assert_ranks_agree(ranks)  # the replicated norms' weights too
    assert_trains_as(ranks[0], reference)
    assert ranks[0]["sharded"] == ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"]  # norms, colwise, rowwise


def test_pipeline_parallel_interleaved_1f1b_trains_as_one_gpu(train, reference):
    """2 stages a rank (4 in all), 2 microbatches; the last stage (rank 1) logs the losses, the first -1."""
    ranks = train(
        2,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    )
    first, last = ranks
    assert losses(first) == [-1.0] * STEPS  # torchtitan's placeholder where no loss is computed
    assert losses(last) == pytest.approx(losses(reference), abs=1e-4)
    # torchtitan 0.2.2 runs a pipeline's backward on the summed loss (the non-pipelined one divides by the
    # step's token count first): the gradient norm it logs is that count (2 x 64 tokens) times the
    # reference's, the same on both stages (reduced over the pipeline); clipping to 1 makes the steps equal
    assert grad_norms(first) == grad_norms(last)
    assert [norm / REF_TOKENS_PER_STEP for norm in grad_norms(last)] == pytest.approx(grad_norms(reference), rel=1e-3)
    assert first["parts"] == last["parts"] == 2
    assert not set(first["weights"]) & set(last["weights"])
    assert set(first["weights"]) | set(last["weights"]) == set(reference["weights"])
    assert_weights_as(first["weights"] | last["weights"], reference["weights"])


@pytest.mark.parametrize("parallelism", ["fsdp", "tensor_parallel"])
def test_compile_on_two_gpus_trains_as_one_gpu(train, workspace, reference, parallelism):
    """`--compile.enable`: each TransformerBlock and the loss through torch.compile (Dynamo traces them,
    `fullgraph=True`); with tensor parallelism the loss is DTensor's loss parallelism, compiled."""
    flags = two_ranks_of_data(workspace) if parallelism == "fsdp" else ("--parallelism.tensor_parallel_degree", "2")
    ranks = train(2, *flags, "--compile.enable")
    assert_ranks_agree(ranks)
    assert_trains_as(ranks[0], reference)
    # one TransformerBlock graph (all 6 share it) and the loss's; with tensor parallelism, the first block's input
    # is the embedding's reduce-scatter, an AsyncCollectiveTensor as on a GPU, and Dynamo compiles the block again
    # for the next block's plain tensor (pytorch/pytorch#187073): torch 2.13 guards on the class, 2.14 unwraps
    # it but guards on the wrapped tensor's requires_grad (False under the collective's autograd node)
    extra = parallelism == "tensor_parallel"
    assert [record["graphs"] for record in ranks] == [2 + extra] * 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float8_emulation_with_fsdp_float8_all_gather_on_two_gpus(train, workspace, reference, compiled):
    """torchao's float8 training, emulated (`emulate=True`): each Linear but the output a Float8Linear, FSDP
    gathering its weights in float8 (torchao's `WeightWithDynamicFloat8CastTensor` around the simulated shard).
    torchtitan compiles it on a GPU of compute capability 8.9 or more (the simulated H100's 9.0)."""
    ranks = train(
        2,
        *two_ranks_of_data(workspace),
        *(["--compile.enable"] if compiled else []),
        "--model.converters",
        "quantize.linear.float8",
        "--quantize.linear.float8.emulate",
        "--quantize.linear.float8.enable_fsdp_float8_all_gather",
        "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
        "--quantize.linear.float8.filter_fqns",
        "output",
    )
    assert_ranks_agree(ranks)
    record = ranks[0]
    assert record["float8_linears"] == 6 * 7  # 4 attention + 3 feed-forward projections in each of 6 layers
    assert "WeightWithDynamicFloat8CastTensor" in record["local_types"]
    # it trains as fp32 does within float8's precision, and not by running fp32
    deltas = [abs(a - b) for a, b in zip(losses(record), losses(reference), strict=True)]
    assert max(deltas) < 0.05 and max(deltas) > 1e-4, deltas
    assert losses(record)[-1] < losses(record)[0] - 0.3
    assert record["graphs"] == (2 if compiled else 0)


def test_fsdp_with_tensor_parallel_on_four_gpus_trains_as_one_gpu(train, workspace, reference):
    """2 data-parallel ranks (FSDP) x 2 tensor-parallel ranks: each weight a DTensor on the 2-D mesh."""
    ranks = train(4, *two_ranks_of_data(workspace), "--parallelism.tensor_parallel_degree", "2")
    assert_ranks_agree(ranks)
    assert_trains_as(ranks[0], reference)
    assert ranks[0]["mesh_dims"] == [2]
    # FSDP shards dim 0 of what tensor parallelism sharded on dim 0 already in strides of its 2 shards
    assert ranks[0]["sharded"] == ["Replicate()", "Shard(dim=0)", "Shard(dim=1)", "_StridedShard(dim=0, sf=2)"]


# -- in each rank: torchtitan's trainer, recording what the checks read ---------------------------------


def run_rank() -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor
    from torchtitan.components import metrics
    from torchtitan.train import Trainer, main

    steps: list[list[float]] = []
    log = metrics.MetricsProcessor.log

    def record(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        steps.append([step, float(global_avg_loss), float(grad_norm)])
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    metrics.MetricsProcessor.log = record

    class Recorded(Trainer):
        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            if not job_config.checkpoint.load_only:
                # the seed checkpoint, as `--checkpoint.create_seed_checkpoint` saves it (that run then stops)
                self.checkpointer.save(curr_step=0, last_step=True)

        def train(self) -> None:
            super().train()
            weights, devices, placements, local_types, meshes = {}, set(), set(), set(), set()
            with torch.no_grad():
                for part in self.model_parts:
                    for name, param in part.named_parameters():
                        devices.add(str(param.device))
                        if isinstance(param, DTensor):
                            placements.update(repr(p) for p in param.placements)
                            meshes.add(param.device_mesh.ndim)
                            local_types.add(type(param.to_local()).__name__)
                        whole = param.full_tensor() if isinstance(param, DTensor) else param
                        whole = whole.double()
                        name = name.replace("._orig_mod", "")  # a block torch.compile wrapped
                        weights[name] = [float(whole.sum()), float(whole.square().sum()), whole.numel()]
            modules = [type(m).__name__ for part in self.model_parts for m in part.modules()]
            result = {
                "steps": steps,
                "weights": weights,
                "devices": sorted(devices),
                "sharded": sorted(placements),
                "local_types": sorted(local_types),
                "mesh_dims": sorted(meshes),
                "parts": len(self.model_parts),
                "float8_linears": modules.count("Float8Linear"),
                "graphs": counters["stats"]["unique_graphs"],
            }
            path = Path(os.environ["TITAN_OUT"]) / f"rank{os.environ['RANK']}.json"
            path.write_text(json.dumps(result))

    main(Recorded)


if __name__ == "__main__":
    run_rank()
