"""Benchmark of FSDP2 on simulated GPUs: a transformer's training step against DDP on them and FSDP2 on CPU ranks.

A small transformer (token embedding, `--layers` pre-norm blocks of causal self-attention
and a 4x MLP, width `--dim`, vocabulary `--vocab`; batch `--batch` x `--seq` tokens,
AdamW) is trained three ways, torch on one thread per rank:

* FSDP2 on `--ranks` simulated GPUs: `fully_shard` per block and at the root, fp32;
* DDP on the same simulated GPU ranks (same model and data);
* FSDP2 on `--ranks` plain CPU ranks (Gloo, `device="cpu"` pool).

Each round runs a block of `--steps` steps of each (FSDP2 and DDP alternately in the same
simulated GPU ranks, then FSDP2 in the CPU ranks; the order flips every round), after
`--warmup` untimed steps, so that the three share the machine's load. Each step is timed
in CPU time of the rank (on a loaded machine it measures the work done, which wall time
does not); wall time is shown too. Medians are over steps, ranks and rounds. The fp32
losses of the FSDP2 runs on simulated GPUs and on CPU ranks are compared.

    python benchmarks/bench_sim_fsdp.py [--ranks 2] [--dim 256] [--layers 4] [--batch 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPE_KEYS = ("dim", "layers", "heads", "vocab", "batch", "seq")


def _model(dim: int, layers: int, heads: int, vocab: int):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)
            self.ffn_norm = nn.LayerNorm(dim)
            self.w1 = nn.Linear(dim, 4 * dim)
            self.w2 = nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, _ = x.shape
            q, k, v = self.qkv(self.attention_norm(x)).view(batch, seq, 3, heads, dim // heads).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(attended.transpose(1, 2).reshape(batch, seq, dim))
            return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h).flatten(0, 1))

    return Transformer()


def _trainer(kind: str, device: str, shape: dict, warmup: int):  # type: ignore[no-untyped-def]
    """(run(steps) -> [(cpu s, wall s) per step], losses) for `kind` ("fsdp2" or "ddp") on `device`."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = _model(shape["dim"], shape["layers"], shape["heads"], shape["vocab"]).to(device)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[rank] if device == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=generator).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].flatten()
    losses: list[float] = []

    def run(steps: int) -> list[tuple[float, float]]:
        times = []
        for _ in range(steps):
            cpu, wall = time.process_time(), time.perf_counter()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            times.append((time.process_time() - cpu, time.perf_counter() - wall))
        return times

    run(warmup)
    return run, losses


def simulated_gpus(shape: dict, steps: int, warmup: int, ddp_first: bool) -> dict:
    """In a simulated GPU rank: a block of FSDP2 steps and a block of DDP steps, alternately."""
    import torch

    torch.set_num_threads(1)
    fsdp, fsdp_losses = _trainer("fsdp2", "cuda", shape, warmup)
    ddp, _ = _trainer("ddp", "cuda", shape, warmup)
    blocks = {}
    for kind in ("ddp", "fsdp2") if ddp_first else ("fsdp2", "ddp"):
        blocks[kind] = (ddp if kind == "ddp" else fsdp)(steps)
    return {**blocks, "losses": fsdp_losses}


def cpu_ranks(shape: dict, steps: int, warmup: int) -> dict:
    """In a plain CPU rank (Gloo): a block of FSDP2 steps."""
    import torch

    torch.set_num_threads(1)
    fsdp, losses = _trainer("fsdp2", "cpu", shape, warmup)
    return {"fsdp2": fsdp(steps), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from accel.sim import launch

    shape = {key: getattr(args, key) for key in SHAPE_KEYS}
    times: dict[str, list[tuple[float, float]]] = {"fsdp2-sim": [], "ddp-sim": [], "fsdp2-cpu": []}
    sim_losses, cpu_losses = [], []
    for round_index in range(args.rounds):
        flip = round_index % 2 == 1

        def on_gpus(flip: bool = flip) -> None:
            task = (shape, args.steps, args.warmup, flip)
            for result in launch(simulated_gpus, args=task, world_size=args.ranks, device="cuda", timeout=600):
                times["fsdp2-sim"] += result["fsdp2"]
                times["ddp-sim"] += result["ddp"]
                sim_losses.append(result["losses"])

        def on_cpus() -> None:
            task = (shape, args.steps, args.warmup)
            for result in launch(cpu_ranks, args=task, world_size=args.ranks, device="cpu", timeout=600):
                times["fsdp2-cpu"] += result["fsdp2"]
                cpu_losses.append(result["losses"])

        for run in (on_cpus, on_gpus) if flip else (on_gpus, on_cpus):
            run()

    cpu_ms = {name: statistics.median(cpu for cpu, _ in steps) * 1e3 for name, steps in times.items()}
    wall_ms = {name: statistics.median(wall for _, wall in steps) * 1e3 for name, steps in times.items()}
    params = sum(p.numel() for p in _model(args.dim, args.layers, args.heads, args.vocab).parameters())
    print(
        f"Transformer: {args.layers} layers, d_model {args.dim}, {args.heads} heads, vocab {args.vocab} "
        f"({params / 1e6:.2f}M parameters); batch {args.batch} x seq {args.seq}, AdamW, fp32; "
        f"{args.ranks} ranks, {args.rounds} rounds of {args.steps} steps each, interleaved"
    )
    labels = {
        "fsdp2-sim": "FSDP2 on simulated GPUs",
        "ddp-sim": "DDP on simulated GPUs",
        "fsdp2-cpu": "FSDP2 on plain CPU ranks",
    }
    for name, label in labels.items():
        print(f"  {label:<26}: {cpu_ms[name]:8.2f} ms CPU per step (median; wall {wall_ms[name]:.2f} ms)")
    print(
        f"  ratio FSDP2 simulated / FSDP2 CPU ranks: {cpu_ms['fsdp2-sim'] / cpu_ms['fsdp2-cpu']:.2f}x "
        f"(wall {wall_ms['fsdp2-sim'] / wall_ms['fsdp2-cpu']:.2f}x; target <= 2x)"
    )
    print(
        f"  ratio FSDP2 simulated / DDP simulated:   {cpu_ms['fsdp2-sim'] / cpu_ms['ddp-sim']:.2f}x "
        f"(wall {wall_ms['fsdp2-sim'] / wall_ms['ddp-sim']:.2f}x)"
    )
    pairs = zip(sim_losses, cpu_losses, strict=True)
    worst = max(abs(a - b) / abs(b) for sim, cpu in pairs for a, b in zip(sim, cpu, strict=True))
    print(f"  fp32 FSDP2 losses, simulated GPUs vs CPU ranks: largest relative difference {worst:.1e}")


if __name__ == "__main__":
    main()
