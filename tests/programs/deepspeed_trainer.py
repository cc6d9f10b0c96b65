"""DeepSpeed through the Transformers Trainer (`TrainingArguments(deepspeed=config)`), nothing downloaded.

It runs unchanged on GPUs (`torchrun` / `accel launch --simulate cuda`). The main process
first saves a small GPT-2 built from a config (no dropout) with `save_pretrained`; then one
launch fine-tunes it once per entry of `--runs`, one after the other in the same processes:
`ddp` is the Trainer without DeepSpeed (DistributedDataParallel, the Trainer's own AdamW),
`zeroN` the Trainer with a DeepSpeed config dict of the Trainer's "auto" values (as in the
Transformers docs) at ZeRO stage N, whose "AdamW" optimizer DeepSpeed builds (FusedAdam on a
GPU). Each run loads the saved model with `from_pretrained` after making its
`TrainingArguments`, as the docs ask, so that under ZeRO-3 Transformers builds it inside
`deepspeed.zero.Init` (partitioned as it is made) and loads the weights into the partitions.

The script does not evaluate before training: with DDP, Transformers 5.23's `evaluate()`
has Accelerate prepare the bare model for evaluation (`prepare_model(evaluation_mode=True)`,
which marks it `_is_accelerate_prepared` without wrapping it), and `train()` then gets it back
unwrapped: no DistributedDataParallel, every rank trains alone on its own batches (the same
on CPU ranks); ZeRO-1/2 refuse it ("ZeRO inference only makes sense with ZeRO Stage 3"). The
main process computes the loss before training itself, on the evaluation set.

The Trainer clips gradients to 1.0 (its default, DeepSpeed's "gradient_clipping": "auto"),
decays the learning rate linearly, logs the loss averaged over the ranks at every step,
evaluates, and saves the model (ZeRO-3: `stage3_gather_16bit_weights_on_model_save`).
Prints, from the main process, one `STEP {"run": ..., "step": i, "loss": ..., "grad_norm":
...}` line per step and one `RESULT {...}` line per run; every rank prints
`CHECKSUM {"run": ..., "rank": ...}` of its full parameters after training (gathered under
ZeRO-3).
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config
from weights_checksum import checksum

parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="ddp,zero1,zero2,zero3")
parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
parser.add_argument("--out", required=True)
args = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size, offset=0):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(self.offset + index))
        ids[1::2] = (ids[::2] * 7 + 3) % 64  # every other token follows from the one before: something to learn
        return {"input_ids": ids, "labels": ids}


class Losses(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({"loss": logs["loss"], "grad_norm": float(logs.get("grad_norm", float("nan")))})


def full_parameters(model):
    """The model's parameters, gathered in full (ZeRO-3) on every rank; tied weights once."""
    parameters = list(model.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=hasattr(parameters[0], "ds_id")):
        return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def deepspeed_config(stage):
    return {
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


pretrained = os.path.join(args.out, "pretrained")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if int(os.environ.get("RANK", "0")) == 0:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    model.save_pretrained(pretrained)
    with torch.no_grad():  # the evaluation loss before training, as the Trainer takes it (batches of 4)
        batches = torch.stack([Tokens(4 * WORLD, offset=1000)[i]["input_ids"] for i in range(4 * WORLD)]).split(4)
        initial = sum(model(input_ids=ids, labels=ids).loss.item() for ids in batches) / len(batches)
    print("INITIAL " + json.dumps({"eval_loss": initial}), flush=True)


def train(run):
    training = TrainingArguments(
        output_dir=os.path.join(args.out, run),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=1,
        learning_rate=5e-3,
        # none: the Trainer's own AdamW decays no bias or LayerNorm weight, while with an optimizer in
        # the DeepSpeed config it hands DeepSpeed all the parameters in one group, decayed alike
        weight_decay=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=args.precision == "bf16",
        disable_tqdm=True,
        seed=0,
        deepspeed=None if run == "ddp" else deepspeed_config(int(run.removeprefix("zero"))),
    )
    world = training.world_size  # sets up the process group
    dist.barrier()  # the main process has saved the model
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    zero3_init = bool(getattr(next(model.parameters()), "ds_id", None) is not None)
    losses = Losses()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(6 * 4 * world),
        eval_dataset=Tokens(4 * WORLD, offset=1000),
        callbacks=[losses],
    )
    trained = trainer.train()
    after = trainer.evaluate()["eval_loss"]
    full = full_parameters(trainer.model)
    mine = checksum(full)
    final = os.path.join(args.out, run, "final")
    trainer.save_model(final)
    engine = trainer.model_wrapped if run != "ddp" else None
    print("CHECKSUM " + json.dumps({"run": run, "rank": training.process_index, **mine}), flush=True)
    dist.barrier()
    if trainer.is_world_process_zero():
        for step, logged in enumerate(losses.steps):
            print("STEP " + json.dumps({"run": run, "step": step, **logged}), flush=True)
        parameter = next(trainer.model.parameters())
        saved = load_file(os.path.join(final, "model.safetensors"))
        result = {
            "run": run,
            "device": str(training.device),
            "world_size": world,
            "parallel_mode": str(training.parallel_mode),
            "zero3_enabled": is_deepspeed_zero3_enabled(),
            "built_partitioned": zero3_init,
            "wrapper": type(trainer.model_wrapped).__name__,
            "optimizer": type(trainer.optimizer.optimizer).__name__,  # what Accelerate's wrapper holds
            "basic_optimizer": type(engine.basic_optimizer if engine else trainer.optimizer.optimizer).__name__,
            "zero_stage": engine.zero_optimization_stage() if engine else None,
            "gradient_clipping": engine.gradient_clipping() if engine else training.max_grad_norm,
            "bf16": engine.bfloat16_enabled() if engine else training.bf16,
            "param_device": str(parameter.device),
            "param_dtype": str(parameter.dtype),
            "global_step": trained.global_step,
            "train_loss": trained.training_loss,
            "eval_loss": after,
            "losses": [logged["loss"] for logged in losses.steps],
            "grad_norms": [logged["grad_norm"] for logged in losses.steps],
            "trained": mine,
            # what `save_model` wrote (ZeRO-1/2 write the tied `lm_head.weight` too, a copy of `wte`'s)
            "saved": checksum({name: tensor for name, tensor in saved.items() if name in full}),
            "saved_extra": sorted(set(saved) - set(full)),
            "saved_files": sorted(os.listdir(final)),
        }
        print("RESULT " + json.dumps(result), flush=True)
    if engine is not None:
        engine.destroy()
    unset_hf_deepspeed_config()


for run in args.runs.split(","):
    train(run)
