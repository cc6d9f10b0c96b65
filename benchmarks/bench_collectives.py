"""Nested-structure collectives of accel vs the equivalent raw `torch.distributed` calls.

Two Gloo ranks on this machine. In each round, both contenders run the same work
back to back (interleaved, so machine noise hits both alike):
- gather: a dict of 16 float tensors and 4 int64 tensors; accel packs them into one
  collective per dtype, the raw loop calls `all_gather_single` once per tensor;
- pad: the same structure with rank-dependent first dimensions; accel exchanges all
  sizes in one collective, the raw loop exchanges each tensor's size separately.
Prints the median time per call and the ratio accel / raw (below 1: accel is faster).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROUNDS = 15
CALLS = 40


def structure(rank: int, uneven: bool) -> dict:
    rows = (lambda i: 4 + (rank + i) % 3) if uneven else (lambda i: 4)
    data = {f"f{i}": torch.randn(rows(i), 8) for i in range(16)}
    data.update({f"i{i}": torch.arange(rows(i)) for i in range(4)})
    return data


def raw_gather(data: dict) -> dict:
    world = dist.get_world_size()
    out = {}
    for key, t in data.items():
        buf = t.new_empty((world * t.shape[0], *t.shape[1:]))
        dist.all_gather_single(buf, t.contiguous())
        out[key] = buf
    return out


def raw_pad(data: dict) -> dict:
    world = dist.get_world_size()
    out = {}
    for key, t in data.items():
        sizes = torch.empty(world, dtype=torch.int64)
        dist.all_gather_single(sizes, torch.tensor([t.shape[0]]))
        biggest = int(sizes.max())
        padded = t.new_zeros((biggest, *t.shape[1:]))
        padded[: t.shape[0]] = t
        out[key] = padded
    return out


def timed(fn, data) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn(data)
    return (time.perf_counter() - start) / CALLS


def rank_main(rank: int, world: int, port: int, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCEL_BACKEND="cpu",
    )
    from accel.state import PartialState
    from accel.utils import gather, pad_across_processes

    PartialState()
    torch.set_num_threads(1)
    cases = {"gather": (gather, raw_gather, False), "pad": (pad_across_processes, raw_pad, True)}
    samples = {name: ([], []) for name in cases}
    for _ in range(ROUNDS):
        for name, (ours, raw, uneven) in cases.items():
            data = structure(rank, uneven)
            samples[name][0].append(timed(ours, data))
            samples[name][1].append(timed(raw, data))
    if rank == 0:
        results.update({name: (statistics.median(a), statistics.median(b)) for name, (a, b) in samples.items()})
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(world, free_port(), results), nprocs=world)
        print(
            f"{world} Gloo ranks, 16 float32 + 4 int64 tensors per structure, median of {ROUNDS} rounds x {CALLS} calls"
        )
        for name, (ours, raw) in results.items():
            print(
                f"{name:>7}: accel {ours * 1e6:8.1f} us   raw per-tensor {raw * 1e6:8.1f} us   ratio {ours / raw:.2f}"
            )


if __name__ == "__main__":
    main()
