"""The largest batch of a small GPT-style transformer that fits on a GPU, with DDP or with FSDP2.

A plain GPU training script: each trial builds the model, takes one AdamW step on a batch
of random tokens and reports its peak memory; batch sizes double until the card runs out
of memory, then a bisection finds the largest that fits. Ranks agree on each outcome.

On real GPUs::

    torchrun --nproc_per_node 2 examples/fit_batch.py --strategy fsdp2

Before renting them, on simulated cards that hold shapes only (nothing is computed, so an
80 GB card is "filled" on a laptop in seconds)::

    accel launch --simulate cuda --gpu L4 --shapes_only --num_processes 2 examples/fit_batch.py --strategy ddp

Both strategies on several cards, side by side (each in simulated ranks of its own)::

    python examples/fit_batch.py --compare L4 H100
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads).unbind(2)
        attention = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def trial(args: argparse.Namespace, batch: int) -> int | None:
    """One training step at `batch` per GPU: its peak allocated bytes, or None if this GPU ran out of memory."""
    device = torch.device("cuda", torch.cuda.current_device())
    # the last trial's model may still be waiting for the garbage collector (FSDP2's modules hold
    # reference cycles): free it now, or it counts against this trial, more or less by chance
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        with device:
            model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq)
        if args.strategy == "ddp":
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(args.vocab, (batch, args.seq + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        peak: int | None = torch.cuda.max_memory_allocated()
    except torch.OutOfMemoryError:
        peak = None
    # every rank must agree, or one would wait in a collective the others never join
    fits = torch.tensor([0 if peak is None else 1], device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return peak if fits.item() else None


def search(args: argparse.Namespace) -> tuple[int, int]:
    """The largest batch per GPU that fits (doubling, then bisection) and its peak memory."""
    best, best_peak, batch = 0, 0, 1
    while batch <= args.max_batch:
        peak = trial(args, batch)
        if peak is None:
            break
        best, best_peak, batch = batch, peak, batch * 2
    low, high = best, min(batch, args.max_batch + 1)
    while high - low > 1:
        middle = (low + high) // 2
        peak = trial(args, middle)
        if peak is None:
            high = middle
        else:
            low, best, best_peak = middle, middle, peak
    return best, best_peak


def run(args: argparse.Namespace) -> tuple[str, int, int]:
    """In each rank: set up, search, report; (card, largest batch, its peak bytes)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        batch, peak = search(args)
    finally:
        dist.destroy_process_group()
    card = torch.cuda.get_device_name()
    if local_rank == 0:
        print(f"{card}, {args.strategy}: largest batch {batch} per GPU, peak {peak / 2**30:.2f} GiB", flush=True)
    return card, batch, peak


def compare(args: argparse.Namespace) -> None:
    """Both strategies on each card of `--compare`, on simulated ranks holding shapes only."""
    import accel.sim

    rows = []
    for card in args.compare:
        for strategy in ("ddp", "fsdp2"):
            options = argparse.Namespace(**{**vars(args), "strategy": strategy, "compare": None})
            name, batch, peak = accel.sim.launch(
                run, (options,), world_size=args.processes, device="cuda", gpu=card, shapes_only=True, timeout=None
            )[0]
            rows.append((name, strategy, batch, peak))
    model = f"{args.layers} layers x {args.width}, vocab {args.vocab}, sequence {args.seq}"
    print(f"GPT ({model}) on {args.processes} GPUs: the largest batch per GPU that fits")
    for name, strategy, batch, peak in rows:
        print(f"  {name:28s} {strategy:6s} batch {batch:5d}   peak {peak / 2**30:6.2f} GiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--max_batch", type=int, default=4096)
    parser.add_argument("--compare", nargs="+", metavar="CARD", help="simulate these cards (e.g. L4 H100) side by side")
    parser.add_argument("--processes", type=int, default=2, help="with --compare: GPUs per run")
    args = parser.parse_args(argv)
    if args.compare:
        compare(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
