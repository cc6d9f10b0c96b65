"""One training step of a Llama 3 model, sharded as torchtitan shards it: FSDP2 x tensor parallelism.

The question a person planning a big run asks of `accel launch --simulate cuda --shapes_only`:
does a step of this model fit on N cards of this kind, and at what peak? This script is that
step, as torchtitan 0.2.2 runs it, written out so that it can be read: torchtitan's own Llama 3
model (`torchtitan.models.llama3`), built on the meta device, parallelised by torchtitan's
`parallelize_llama` (tensor parallelism on the "tp" mesh dimension with loss parallelism,
activation checkpointing, `fully_shard` on the "fsdp" dimension with bf16 parameters and fp32
gradient reduction), moved to the GPU and initialised, then one step: forward, the summed
cross-entropy divided by the global token count, backward, gradient clipping (torchtitan's
`clip_grad_norm_`), AdamW (foreach, as torchtitan builds it).

The default shapes are Llama-3-70B's (torchtitan's "70B" flavour: hidden 8192, 80 layers, 64
heads, 8 key/value heads, feed-forward 28672, vocabulary 128256); `--layers`, `--dim`, ... make
smaller ones for tests. Run it as torchrun would, e.g.

    accel launch --simulate cuda --shapes_only --num_processes 64 tests/programs/plan_llama.py --tp_degree 8

Each rank prints one line, ``plan_llama: rank R of W: ...``, with its model's shapes and the
peak memory of its GPU (allocated and reserved, whole run); with `--out DIR` it also writes
them to ``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The model's shapes (default: Llama-3-70B's), the layout and the batch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--ffn_dim_multiplier", type=float, default=1.3)
    parser.add_argument("--multiple_of", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument(
        "--tp_degree", type=int, default=8, help="tensor-parallel degree (the rest of the world is FSDP)"
    )
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--local_batch", type=int, default=1)
    parser.add_argument("--ac", choices=["none", "full", "selective"], default="full", help="activation checkpointing")
    parser.add_argument("--out", type=Path, default=None, help="folder for each rank's rank<R>.json")
    return parser.parse_args(argv)


def model_args(args: argparse.Namespace) -> Any:
    """torchtitan's `TransformerModelArgs` for these shapes."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    return TransformerModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        ffn_dim_multiplier=args.ffn_dim_multiplier,
        multiple_of=args.multiple_of,
        rope_theta=500000,
        max_seq_len=args.seq_len,
    )


def job_config(args: argparse.Namespace, world: int) -> Any:
    """The parts of torchtitan's `JobConfig` that `parallelize_llama` reads (its llama3_70b.toml's choices)."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.training.seq_len = args.seq_len
    job.training.local_batch_size = args.local_batch
    job.training.mixed_precision_param = "bfloat16"
    job.training.mixed_precision_reduce = "float32"
    job.parallelism.tensor_parallel_degree = args.tp_degree
    job.parallelism.data_parallel_shard_degree = world // args.tp_degree
    job.activation_checkpoint.mode = args.ac
    job.compile.enable = False
    return job


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model on this rank's GPU, parallelised as torchtitan does; (model, parallel dims, job config)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.model import Transformer

    world = int(os.environ["WORLD_SIZE"])
    if world % args.tp_degree:
        raise SystemExit(f"plan_llama: --tp_degree {args.tp_degree} does not divide the world size {world}")
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=args.tp_degree, pp=1, ep=1, etp=1, world_size=world)
    job = job_config(args, world)
    with torch.device("meta"):
        model = Transformer(model_args(args))
    parallelize_llama(model, dims, job)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights()
    model.train()
    return model, dims, job


def step(model: Any, dims: Any, job: Any, args: argparse.Namespace) -> None:
    """One step of torchtitan's trainer (non-pipelined): forward, loss, backward, clipping, AdamW."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True
    )
    shape = (args.local_batch, args.seq_len)
    inputs = torch.randint(args.vocab, shape, device="cuda")
    labels = torch.randint(args.vocab, shape, device="cuda")
    local_tokens = torch.tensor(labels.numel(), dtype=torch.int64, device="cuda")
    if dims.dp_enabled:  # torchtitan's global token count (a sum over the data-parallel ranks)
        global_tokens = dist_utils.dist_sum(local_tokens, dims.get_mesh("batch"))
    else:
        global_tokens = local_tokens.float()
    parallel_loss = dims.tp_enabled and not job.parallelism.disable_loss_parallel
    optimizer.zero_grad()
    with dist_utils.get_train_context(parallel_loss)():
        pred = model(inputs)
        loss = cross_entropy_loss(pred, labels) / global_tokens
        del pred  # torchtitan frees the logits before backward
        loss.backward()
    dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad()


def report(args: argparse.Namespace, dims: Any) -> dict[str, Any]:
    """This rank's record: its place in the layout and its GPU's peak memory (whole run)."""
    import accel.sim

    peak = accel.sim.peak_memory()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    record = {
        "rank": rank,
        "world": world,
        "tp": dims.tp,
        "fsdp": dims.dp_shard,
        "device": str(torch.device("cuda", torch.cuda.current_device())),
        "peak_allocated": peak.allocated,
        "peak_reserved": peak.reserved,
        # what simulating this rank cost its host process (not the GPU's figures)
        "cpu_seconds": time.process_time(),
        "host_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    gib = 2**30
    print(
        f"plan_llama: rank {rank} of {world} (fsdp {dims.dp_shard} x tp {dims.tp}; {args.layers} layers x {args.dim}, "
        f"sequence {args.seq_len}, batch {args.local_batch}): peak allocated {peak.allocated / gib:.2f} GiB, "
        f"reserved {peak.reserved / gib:.2f} GiB",
        flush=True,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model, dims, job = build(args)
    step(model, dims, job, args)
    report(args, dims)


if __name__ == "__main__":
    main()
