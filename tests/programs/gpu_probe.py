"""A plain one-GPU script that writes down what a GPU answers: memory as the caching allocator
counts it, the errors of common GPU bugs, autocast's dtypes, peaks of training steps.

Run on a real GPU (``torchrun --nproc_per_node 1 gpu_probe.py --out real.json``) and on a
simulated one (``accel launch --simulate cuda --gpu H200 --num_processes 1 gpu_probe.py
--out sim.json``); tests/test_gpu_probe.py compares the simulated answers with a record of
the real card's (tests/data/gpu_probe_*.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MiB = 2**20


def memory_sequence(device: torch.device) -> list[list[int]]:
    """(allocated, reserved) after each step of a fixed sequence of allocations and frees."""
    seen: list[list[int]] = []

    def note() -> None:
        seen.append([torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)])

    kept = []
    for size in (1, 1000, 512 * 1024, MiB, MiB + 1, 5 * MiB, 12 * MiB, 100 * MiB + 3):
        kept.append(torch.empty(size, dtype=torch.uint8, device=device))
        note()
    view = kept[-1][10:20].view(2, 5)  # a view: no new memory
    note()
    del view
    del kept[3]
    note()
    del kept[-1]
    note()
    torch.cuda.empty_cache()
    note()
    kept.clear()
    note()
    torch.cuda.empty_cache()
    note()
    return seen


def errors(device: torch.device) -> dict[str, str]:
    """The message of each common GPU bug (numbers masked where the card decides them)."""
    found: dict[str, str] = {}
    gpu = torch.ones(2, device=device)

    def attempt(name: str, action) -> None:
        try:
            action()
        except Exception as error:  # whatever the GPU raises is what we record
            found[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        else:
            found[name] = "no error"

    attempt("add_cpu", lambda: gpu + torch.ones(2))
    attempt("linear_cpu_input", lambda: nn.Linear(2, 2).to(device)(torch.ones(1, 2)))
    attempt("numpy", lambda: gpu.numpy())
    attempt("matmul_cpu", lambda: torch.mm(torch.ones(2, 2, device=device), torch.ones(2, 2)))
    attempt("index_cpu_tensor_with_gpu_index", lambda: torch.ones(3)[torch.tensor([0, 1], device=device)])
    attempt("copy_across_with_out", lambda: torch.add(gpu, gpu, out=torch.empty(2)))
    attempt("bad_ordinal", lambda: torch.ones(1, device=f"cuda:{torch.cuda.device_count()}"))
    attempt("set_device_bad", lambda: torch.cuda.set_device(torch.cuda.device_count()))
    attempt("cross_entropy_cpu_target", lambda: F.cross_entropy(torch.ones(2, 3, device=device), torch.zeros(2).long()))
    attempt("item_ok", lambda: gpu.sum().item())
    huge = torch.cuda.get_device_properties(device).total_memory * 2
    attempt("oom", lambda: torch.empty(huge, dtype=torch.uint8, device=device))
    if dist.is_initialized():
        attempt("nccl_cpu_tensor", lambda: dist.all_reduce(torch.ones(1)))
    return {name: re.sub(r"\d+(\.\d+)? ?(GiB|MiB|KiB|bytes)", "<size>", text) for name, text in found.items()}


def autocast_dtypes(device: torch.device) -> dict[str, str]:
    a = torch.randn(4, 4, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        results = {
            "mm": (a @ a).dtype,
            "linear": F.linear(a, a).dtype,
            "softmax": torch.softmax(a, -1).dtype,
            "layer_norm": F.layer_norm(a, (4,)).dtype,
            "sum": a.sum().dtype,
            "add": (a + a).dtype,
            "mse": F.mse_loss(a, a).dtype,
            "bmm": torch.bmm(a[None], a[None]).dtype,
        }
    return {name: str(dtype) for name, dtype in results.items()}


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)  # built on the CPU, so the GPU and the simulation start from the same weights
    return nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))


def training_peaks(device: torch.device) -> dict[str, object]:
    """Peak allocated memory (and fp32 losses) of a few Adam steps of an MLP, fp32 and bf16."""
    found: dict[str, object] = {}
    for mode in ("fp32", "bf16"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        model = mlp(512).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randn(64, 512, generator=generator).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = F.mse_loss(model(x).float(), x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        found[mode] = {
            "peak_allocated": torch.cuda.max_memory_allocated(device) - start,
            "peak_reserved": torch.cuda.max_memory_reserved(device),
            "losses": losses,
        }
        del model, optimizer, x, loss
    return found


def fsdp2_peak(device: torch.device) -> dict[str, object]:
    """Peak allocated memory and losses of FSDP2 steps (one rank: every parameter kept whole)."""
    from torch.distributed.fsdp import fully_shard

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    model = mlp(256).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(3):
        x = torch.randn(32, 256, generator=generator).to(device)
        loss = F.mse_loss(model(x), x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"peak_allocated": torch.cuda.max_memory_allocated(device) - start, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    properties = torch.cuda.get_device_properties(device)
    record: dict[str, object] = {
        "torch": torch.__version__,
        "name": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "total_memory": properties.total_memory,
        "multi_processor_count": properties.multi_processor_count,
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "accelerator": str(torch.accelerator.current_accelerator()),
        "memory_sequence": memory_sequence(device),
    }
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=device)
    record["errors"] = errors(device)
    record["autocast_bf16"] = autocast_dtypes(device)
    record["training"] = training_peaks(device)
    if dist.is_initialized():
        record["fsdp2"] = fsdp2_peak(device)
        dist.destroy_process_group()
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
