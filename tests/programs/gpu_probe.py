"""A plain one-GPU script that writes down what a GPU answers: memory as the caching allocator
counts it, the errors of common GPU bugs, autocast's dtypes, peaks of training steps.

Run on a real GPU (``torchrun --nproc_per_node 1 gpu_probe.py --out real.json``) and on a
simulated one (``accel launch --simulate cuda --gpu H200 --num_processes 1 gpu_probe.py
--out sim.json``); tests/test_gpu_probe.py compares the simulated answers with a record of
the real card's (tests/data/gpu_probe_*.json).

Sections: the card; `memory_sequence`; the same under expandable segments switched on at run time
(`expandable_segments`); errors; autocast's dtypes; training peaks; with a process group (torchrun),
FSDP2 steps (`fsdp2_peak`); grouped-query attention by SDPA, default and FLASH / EFFICIENT forced
(`gqa_attention`); a small bf16 Llama under FSDP2, without and with selective activation
checkpointing, eager and with compiled blocks (`fsdp2_sac_llama`: on the card, whether Inductor
keeps more than eager checkpointing under per-op SAC tags, which the simulator does not yet model);
a compiled float32 loss and a compiled MLP block against eager (`compiled_regions`: what Inductor's
kernels hold). ``--skip gqa_attention fsdp2_sac_llama compiled_regions`` leaves out the last three
(slow to simulate; they run after the others, so the others' numbers do not change).

Recording a real card (the next session lent an H100 or H200; the device machine's plain ``python3``
holds a CUDA torch, 2.11 when last seen, which the record notes under "torch"). One `run` call from the
repository root, about 2 minutes of device time; it writes the four records the tests read, for the
card it is on (``o=$OUT/gpu_probe_h100_real`` on an H100)::

    set -e; o=$OUT/gpu_probe_h200_real; p=tests/programs/gpu_probe.py
    r="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
    nvidia-smi --query-gpu=name --format=csv,noheader
    $r $p --out $o.json
    CUBLAS_WORKSPACE_CONFIG=:16:8 $r $p --out ${o}_ws16.json
    TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 $r $p --out ${o}_unified1.json
    CUBLAS_WORKSPACE_CONFIG=:16:8 TORCH_CUBLASLT_UNIFIED_WORKSPACE=0 $r $p --out ${o}_ws16_unified0.json

Then copy the files from the reply's files_at into tests/data/ (for an H200 they replace the records
there; ``git diff tests/data`` should change no old key's value, or find out why) and run
``.venv/bin/python -m pytest -q tests/test_gpu_probe.py`` here: the tests compare the new sections
where the record has them (expandable_segments, gqa_attention, fsdp2_sac_llama, compiled_regions) and
otherwise check the simulated run only for consistency. An H100's records (gpu_probe_h100_real*.json)
are not read by the tests yet: compare by hand with ``.venv/bin/accel launch --simulate cuda --gpu H100
--num_processes 1 tests/programs/gpu_probe.py --out sim.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import warnings

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


#: the allocator's counters `expandable_segments` records (what a run added to each)
COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "segment.all.allocated", "segment.all.freed")


def expandable_segments(device: torch.device) -> dict[str, object]:
    """`memory_sequence` again with fixed segments, then with expandable ones switched on at run time
    (``PYTORCH_CUDA_ALLOC_CONF`` is read only when CUDA starts), and what each added to the counters.
    Runs on an empty allocator (right after `memory_sequence`) and switches expandable segments off after."""
    found: dict[str, object] = {}
    for setting in ("False", "True"):
        set_allocator_settings(f"expandable_segments:{setting}")
        before = torch.cuda.memory_stats(device)
        sequence = memory_sequence(device)
        after = torch.cuda.memory_stats(device)
        counts = {key: after.get(key, 0) - before.get(key, 0) for key in COUNTERS}
        found["expandable" if setting == "True" else "fixed"] = {"sequence": sequence, "counters": counts}
    set_allocator_settings("expandable_segments:False")
    return found


def set_allocator_settings(text: str) -> None:
    """`torch.cuda.memory._set_allocator_settings(text)`, by the name it has had since torch 2.9 (the old one warns)."""
    getattr(torch._C, "_accelerator_setAllocatorSettings", torch.cuda.memory._set_allocator_settings)(text)


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


def gqa_attention(device: torch.device) -> dict[str, object]:
    """Grouped-query attention (bf16, 8 query heads over 2 key/value heads, causal) forward and backward, with
    the backends torch picks and with FLASH and EFFICIENT forced: the backward's name (the kernel that ran),
    memory after the forward and the peak of both (over the inputs), or the error and warnings if refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, heads, 1024, 64, generator=generator) for heads in (8, 2, 2)]
    found: dict[str, object] = {}
    for name, backend in (
        ("default", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        torch.cuda.empty_cache()
        q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in inputs)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        with (
            warnings.catch_warnings(record=True) as caught,
            sdpa_kernel(backend) if backend is not None else contextlib.nullcontext(),
        ):
            warnings.simplefilter("always")
            try:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except RuntimeError as error:
                said = [re.sub(r"\s*\(Triggered internally at .*", "", str(w.message), flags=re.S) for w in caught]
                found[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}", "warnings": said}
                continue
            after_forward = torch.cuda.memory_allocated(device) - start
            out.sum().backward()
        found[name] = {
            "grad_fn": type(out.grad_fn).__name__,
            "allocated_after_forward": after_forward,
            "peak_allocated": torch.cuda.max_memory_allocated(device) - start,
            "grad_norms": [t.grad.float().norm().item() for t in (q, k, v)],
        }
        del q, k, v, out
    return found


class Block(nn.Module):
    """A Llama block: RMSNorm, grouped-query attention by SDPA, RMSNorm, SwiGLU MLP (no rotary embedding);
    with `selective`, run under per-op selective activation checkpointing that keeps matmuls and attention."""

    def __init__(self, dim: int = 256, heads: int = 8, kv_heads: int = 2, hidden: int = 768) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.selective = heads, kv_heads, False
        kv_dim = dim // heads * kv_heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, n, bias=False) for n in (dim, kv_dim, kv_dim, dim))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.selective:
            return self.layers(x)
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        context = functools.partial(create_selective_checkpoint_contexts, SAVED_OPS)
        return checkpoint(self.layers, x, use_reentrant=False, context_fn=context)

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, length, self.heads, -1).transpose(1, 2)
        k = self.wk(h).view(b, length, self.kv_heads, -1).transpose(1, 2)
        v = self.wv(h).view(b, length, self.kv_heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, length, dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


#: what selective activation checkpointing keeps (torchtitan's "op" policy, every matmul); the rest is recomputed
SAVED_OPS = [
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
]


def llama(vocab: int, blocks: int, selective: bool) -> nn.Module:
    torch.manual_seed(0)  # built on the CPU, so the GPU and the simulation start from the same weights
    model = nn.Sequential(nn.Embedding(vocab, 256), *(Block() for _ in range(blocks)), nn.RMSNorm(256))
    model.append(nn.Linear(256, vocab, bias=False))
    for block in model[1 : blocks + 1]:
        block.selective = selective
    return model.to(torch.bfloat16)


def fsdp2_sac_llama(device: torch.device) -> dict[str, object]:
    """A small bf16 Llama, FSDP2 per block and at the root (one rank), 3 AdamW steps without activation
    checkpointing and with selective (per-op) checkpointing, each eager and with every block compiled
    (Inductor, on the card): peak allocated (over the start) and reserved of each step, and the losses."""
    from torch.distributed.fsdp import fully_shard

    vocab, blocks = 512, 2
    found: dict[str, object] = {}
    for mode in ("no_ac", "selective_ac", "no_ac_compiled", "selective_ac_compiled"):
        torch.cuda.empty_cache()
        start = torch.cuda.memory_allocated(device)
        model = llama(vocab, blocks, selective=mode.startswith("selective_ac")).to(device)
        for i in range(1, blocks + 1):
            if mode.endswith("_compiled"):  # each block compiled, then sharded, as torchtitan does
                model[i] = torch.compile(model[i])
            fully_shard(model[i])
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(4)
        steps: dict[str, list] = {"peak_allocated": [], "peak_reserved": [], "losses": []}
        for _ in range(3):
            tokens = torch.randint(vocab, (4, 513), generator=generator).to(device)
            torch.cuda.reset_peak_memory_stats(device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps["losses"].append(loss.item())
            steps["peak_allocated"].append(torch.cuda.max_memory_allocated(device) - start)
            steps["peak_reserved"].append(torch.cuda.max_memory_reserved(device))
        found[mode] = steps
        del model, optimizer, tokens, logits, loss
    return found


def compiled_regions(device: torch.device) -> dict[str, object]:
    """Memory of compiled regions as Inductor's kernels hold it: a float32 cross-entropy over bf16 logits and
    a small bf16 MLP block, each eager and compiled (default backend): bytes held for backward after the
    forward, and the step's peak, over what was allocated before it (after one step that compiles)."""
    found: dict[str, object] = {}
    vocab, tokens, hidden = 32000, 2048, 64
    for compiled in (False, True):
        torch.manual_seed(0)
        head = nn.Linear(hidden, vocab, bias=False).to(device, torch.bfloat16)
        block = mlp(256).to(device, torch.bfloat16)

        def loss_fn(x: torch.Tensor, y: torch.Tensor, head: nn.Module = head) -> torch.Tensor:
            return F.cross_entropy(head(x).float(), y)

        def block_fn(x: torch.Tensor, block: nn.Module = block) -> torch.Tensor:
            return F.gelu(block(x)).float().square().mean()

        for name, fn, inputs in (
            ("loss", loss_fn, (torch.randn(tokens, hidden), torch.randint(0, vocab, (tokens,)))),
            ("block", block_fn, (torch.randn(4096, 256),)),
        ):
            step = torch.compile(fn) if compiled else fn
            args = [t.to(device, torch.bfloat16) if t.is_floating_point() else t.to(device) for t in inputs]
            step(*args).backward()  # compiles
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss = step(*args)
            held = torch.cuda.memory_allocated(device) - base
            loss.backward()
            torch.cuda.synchronize(device)
            key = f"{name}_{'compiled' if compiled else 'eager'}"
            found[key] = {"held": held, "peak": torch.cuda.max_memory_allocated(device) - base, "loss": loss.item()}
            del loss
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["gqa_attention", "fsdp2_sac_llama", "compiled_regions"],
        help="(slow to simulate)",
    )
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
        "expandable_segments": expandable_segments(device),
    }
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=device)
    record["errors"] = errors(device)
    record["autocast_bf16"] = autocast_dtypes(device)
    record["training"] = training_peaks(device)
    if dist.is_initialized():
        record["fsdp2"] = fsdp2_peak(device)
    if "gqa_attention" not in args.skip:
        record["gqa_attention"] = gqa_attention(device)
    if dist.is_initialized() and "fsdp2_sac_llama" not in args.skip:
        record["fsdp2_sac_llama"] = fsdp2_sac_llama(device)
    if "compiled_regions" not in args.skip:
        record["compiled_regions"] = compiled_regions(device)
    if dist.is_initialized():
        dist.destroy_process_group()
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
