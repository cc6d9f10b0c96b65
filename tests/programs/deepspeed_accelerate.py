"""DeepSpeed through Accelerate (`Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))`), as its users write it.

It runs unchanged on GPUs (`accelerate launch` / `torchrun` / `accel launch --simulate cuda`).
One launch trains the same small MLP once per entry of `--runs`, one after the other in the
same processes (Accelerate's shared state is reset between them, as Accelerate's own tests
reset it): `ddp` is Accelerate without DeepSpeed (DistributedDataParallel, torch's AdamW),
`zeroN:torch` is `DeepSpeedPlugin(zero_stage=N)` with torch's AdamW passed to `prepare`
(DeepSpeed takes it as its client optimizer), `zeroN:config` a DeepSpeed config dict of
Accelerate's "auto" values with an "AdamW" optimizer, for which the script passes
Accelerate's `DummyOptim` and DeepSpeed builds its own (FusedAdam on a GPU).

The loop is Accelerate's usual one: `accelerator.backward(loss)` (under DeepSpeed it also
steps), `accelerator.clip_grad_norm_` (under DeepSpeed the norm DeepSpeed clipped with, to
the plugin's `gradient_clipping`), `optimizer.step()`, `optimizer.zero_grad()`; the data come
from a prepared DataLoader. After training, `accelerator.get_state_dict` gives the full
weights to the main process (ZeRO-3: `zero3_save_16bit_model`); `save_state` writes a
checkpoint (under DeepSpeed in DeepSpeed's format, a file per rank's partition, which the
main process puts back together with DeepSpeed's `zero_to_fp32`), one more step moves the
weights and `load_state` brings them back.

Prints, from the main process, one `STEP {"run": ..., "step": i, "loss": ..., "grad_norm":
...}` line per step (the loss averaged over the ranks) and one `RESULT {...}` line per run;
every rank prints `CHECKSUM {"run": ..., "rank": ...}` of its full parameters (gathered under
ZeRO-3) after training, and the main process also that of the state dict it got.
"""

import argparse
import json
import os

import deepspeed
import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.state import AcceleratorState
from accelerate.utils import DummyOptim, set_seed
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from weights_checksum import checksum

parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="ddp,zero1:torch,zero2:torch,zero3:torch")
parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
parser.add_argument("--clip", type=float, default=0.5)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--out", required=True)
args = parser.parse_args()

LR, WEIGHT_DECAY, BATCH = 1e-2, 0.01, 8


def full_parameters(accelerator, model):
    """This rank's parameters, gathered in full (ZeRO-3) on every rank."""
    module = accelerator.unwrap_model(model)
    parameters = list(module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=hasattr(parameters[0], "ds_id")):
        return {name: p.detach().float().cpu().clone() for name, p in module.named_parameters()}


def plugin(run):
    stage, optimizer = run.removeprefix("zero").split(":")
    if optimizer == "torch":
        return DeepSpeedPlugin(zero_stage=int(stage), gradient_clipping=args.clip, zero3_save_16bit_model=True)
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8},
        },
        "zero_optimization": {"stage": int(stage), "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": "auto"},
    }
    return DeepSpeedPlugin(hf_ds_config=config)


def train(run):
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # the Accelerator of a DeepSpeed run set it
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, deepspeed_plugin=None if run == "ddp" else plugin(run)
    )
    set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH * accelerator.num_processes * (args.steps + 1), 8, generator=generator)
    targets = torch.sin(inputs @ torch.randn(8, 1, generator=generator))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=BATCH)
    if run.endswith(":config"):
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)

    def step():
        x, y = next(batches)
        # DeepSpeed's bf16 holds the weights in bf16 and does not cast inputs; Accelerate's own autocasts
        x = x.to(next(model.parameters()).dtype)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad()
        return accelerator.reduce(loss.detach(), "mean").item(), float(norm)

    history = [step() for _ in range(args.steps)]
    mine = checksum(full_parameters(accelerator, model))
    # the state dict Accelerate saves; under ZeRO-3 only the main process gets it
    state = accelerator.get_state_dict(model)
    trained = checksum(state) if state is not None else None
    path = os.path.join(args.out, run.replace(":", "-"))
    accelerator.save_state(path)
    accelerator.wait_for_everyone()
    consolidated = None
    if run != "ddp" and accelerator.is_main_process:
        # DeepSpeed's checkpoint, each rank's partition in its own file, put back together as its users do
        consolidated = checksum(get_fp32_state_dict_from_zero_checkpoint(path, tag="pytorch_model"))
    step()
    moved = checksum(full_parameters(accelerator, model))
    accelerator.load_state(path)
    reloaded = checksum(full_parameters(accelerator, model))

    if accelerator.is_main_process:
        for i, (loss, norm) in enumerate(history):
            print("STEP " + json.dumps({"run": run, "step": i, "loss": loss, "grad_norm": norm}), flush=True)
    print("CHECKSUM " + json.dumps({"run": run, "rank": accelerator.process_index, **mine}), flush=True)
    accelerator.wait_for_everyone()
    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = engine.engine if engine is not None else None
    if accelerator.is_main_process:
        parameter = next(model.parameters())
        result = {
            "run": run,
            "distributed_type": str(accelerator.distributed_type),
            "device": str(accelerator.device),
            "world_size": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "model": type(model).__name__,
            "optimizer": type(optimizer.optimizer).__name__,
            "basic_optimizer": type(engine.basic_optimizer).__name__ if engine else type(optimizer.optimizer).__name__,
            "zero_stage": engine.zero_optimization_stage() if engine else None,
            "gradient_clipping": engine.gradient_clipping() if engine else args.clip,
            "bf16": engine.bfloat16_enabled() if engine else None,
            "param_device": str(parameter.device),
            "param_dtype": str(parameter.dtype),
            "losses": [loss for loss, _ in history],
            "grad_norms": [norm for _, norm in history],
            "trained": mine,
            "state_dict": trained,
            "moved": moved,
            "reloaded": reloaded,
            "saved": sorted(os.listdir(path)),
            "consolidated": consolidated,
        }
        print("RESULT " + json.dumps(result), flush=True)
    if engine is not None:
        engine.destroy()
    accelerator.free_memory()


for run in args.runs.split(","):
    train(run)
