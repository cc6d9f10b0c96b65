"""DeepSpeed used directly (`deepspeed.initialize`), as its users write a script for a GPU node.

It runs unchanged on GPUs (`torchrun` / `accel launch --simulate cuda`) and on CPU ranks
(`accel launch --simulate cpu`, where DeepSpeed picks its CPU accelerator itself). One launch
trains the same small MLP once per entry of `--runs`, one after the other in the same
processes: `ddp` is torch's DistributedDataParallel with torch's AdamW (the reference, always
fp32), `zero0` .. `zero3` DeepSpeed's engine at that ZeRO stage with the optimizer DeepSpeed
builds from an "AdamW" config (FusedAdam on a GPU), in `--precision` fp32, bf16 or fp16
(DeepSpeed's dynamic loss scale, starting at 2**`--loss_scale_power`). ZeRO-3
runs with `stage3_param_persistence_threshold: 0`, so that it gathers and releases every
parameter at every step (by default it keeps small parameters whole after the first step).

Each rank trains on its own slice of a fixed data set (`--accumulate` micro-batches of 8 per
rank and step; the DDP reference takes them as one batch), so every run sees the same
samples. Prints, from rank 0, one JSON line per step (`STEP {"run": ..., "step": i, "loss":
...}`, the loss averaged over the ranks and micro-batches) and one `RESULT {...}` line per
run, with the loss over the whole data set before and after training; every rank prints
`CHECKSUM {"run": ..., "rank": ...}` with a checksum of its full parameters (gathered under
ZeRO-3) and the number of elements of Adam's state it holds (a ZeRO stage of 1 or more
holds only its partition).
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from weights_checksum import checksum

parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="ddp,zero1,zero2,zero3")
parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
parser.add_argument("--loss_scale_power", type=int, default=16, help="fp16: the first dynamic loss scale is 2**this")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--clip", type=float, default=0.0, help="gradient clipping to this norm (0: none)")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (gradient accumulation)")
parser.add_argument("--bucket", type=int, default=0, help="ZeRO's bucket sizes, in elements (0: DeepSpeed's)")
parser.add_argument("--out", required=True)
args = parser.parse_args()

SETTINGS = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
MICRO_BATCH = 8

deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
on_gpu = get_accelerator().device_name() == "cuda"
if on_gpu:
    torch.cuda.set_device(local_rank)
generator = torch.Generator().manual_seed(1)
INPUTS = torch.randn(MICRO_BATCH * args.accumulate * world * args.steps, 8, generator=generator)
TARGETS = torch.sin(INPUTS @ torch.randn(8, 1, generator=generator))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


def micro_batches(step, device, dtype):
    """This rank's micro-batches of the step."""
    for micro in range(args.accumulate):
        start = ((step * args.accumulate + micro) * world + rank) * MICRO_BATCH
        x, y = INPUTS[start : start + MICRO_BATCH], TARGETS[start : start + MICRO_BATCH]
        yield x.to(device, dtype), y.to(device, dtype)


def mean_over_ranks(value):
    value = torch.tensor(float(value), device=torch.device("cuda", local_rank) if on_gpu else "cpu")
    dist.all_reduce(value)
    return value.item() / world


@torch.no_grad()
def evaluate(model, device, dtype):
    """The loss over the whole data set (the same on every rank)."""
    return torch.nn.functional.mse_loss(model(INPUTS.to(device, dtype)).float(), TARGETS.to(device)).item()


def adam_state_numel(optimizer):
    """How many elements of Adam's first moment this rank holds."""
    return sum(state["exp_avg"].numel() for state in optimizer.state.values() if "exp_avg" in state)


def train_ddp():
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    model = torch.nn.parallel.DistributedDataParallel(mlp().to(device), device_ids=[local_rank] if on_gpu else None)
    betas = tuple(SETTINGS["betas"])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=SETTINGS["lr"], betas=betas, eps=SETTINGS["eps"], weight_decay=SETTINGS["weight_decay"]
    )
    before = evaluate(model.module, device, torch.float32)
    losses, norms = [], []
    for step in range(args.steps):
        batches = list(micro_batches(step, device, torch.float32))
        x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf")).item())
        optimizer.step()
        losses.append(mean_over_ranks(loss.item()))
    after = evaluate(model.module, device, torch.float32)
    parameters = {name: p.detach().float().cpu().clone() for name, p in model.module.named_parameters()}
    info = {"engine": "DistributedDataParallel", "optimizer": "AdamW", "basic_optimizer": "AdamW"}
    first = next(model.parameters())
    info |= {"param_device": str(first.device), "param_dtype": str(first.dtype), "eval": [before, after]}
    info["grad_norms"] = norms
    return losses, parameters, adam_state_numel(optimizer), info


def train_deepspeed(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if args.bucket:
        zero |= {"reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket, "overlap_comm": True}
        if stage == 3:
            zero |= {"stage3_prefetch_bucket_size": args.bucket, "stage3_max_live_parameters": args.bucket}
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": args.accumulate,
        "optimizer": {"type": "AdamW", "params": dict(SETTINGS)},
        "zero_optimization": zero,
        "gradient_clipping": args.clip,  # DeepSpeed's default is 1.0; 0 turns clipping off
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": args.precision == "fp16", "initial_scale_power": args.loss_scale_power},
        "steps_per_print": 1000,
    }
    model = mlp()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    before = evaluate(engine, engine.device, dtype)
    losses, norms = [], []
    for step in range(args.steps):
        total = 0.0
        for x, y in micro_batches(step, engine.device, dtype):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the last micro-batch of the step
            total += loss.item() / args.accumulate
        losses.append(mean_over_ranks(total))
        norm = engine.get_global_grad_norm()  # the norm of the step's gradients, before clipping
        norms.append(float(norm) if norm is not None else None)
    after = evaluate(engine, engine.device, dtype)
    module_parameters = list(engine.module.parameters())
    info = {
        "engine": type(engine).__name__,
        "optimizer": type(optimizer).__name__,
        "basic_optimizer": type(engine.basic_optimizer).__name__,
        "zero_stage": engine.zero_optimization_stage(),
        "global_steps": engine.global_steps,
        "param_device": str(module_parameters[0].device),
        "param_dtype": str(module_parameters[0].dtype),
        # ZeRO-3 leaves an empty placeholder in each parameter outside its module's forward and backward
        "param_numel_outside_forward": sum(p.numel() for p in module_parameters),
        "eval": [before, after],
        "grad_norms": norms,
        "skipped_steps": engine.skipped_steps,  # fp16: steps whose gradients overflowed, skipped
        "loss_scale": float(getattr(engine.optimizer, "cur_scale", 1.0)),
    }
    with deepspeed.zero.GatheredParameters(module_parameters, enabled=stage == 3):
        parameters = {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
    numel = adam_state_numel(engine.basic_optimizer)
    engine.destroy()
    return losses, parameters, numel, info


extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
for run in args.runs.split(","):
    losses, parameters, numel, info = train_ddp() if run == "ddp" else train_deepspeed(int(run.removeprefix("zero")))
    trained = checksum(parameters)
    for step, loss in enumerate(losses):
        if rank == 0:
            print("STEP " + json.dumps({"run": run, "step": step, "loss": loss}), flush=True)
    print("CHECKSUM " + json.dumps({"run": run, "rank": rank, "adam_state_numel": numel, **trained}), flush=True)
    dist.barrier()
    if rank == 0:
        result = {
            "run": run,
            "world_size": world,
            "accelerator": get_accelerator().device_name(),
            "backend": dist.get_backend(),
            "losses": losses,
            "trained": trained,
            "numel": sum(p.numel() for p in parameters.values()),
            "extensions_written": sorted(os.listdir(extensions)) if extensions and os.path.isdir(extensions) else [],
            **info,
        }
        print("RESULT " + json.dumps(result), flush=True)
