"""One FSDP2 training script for Accelerate and accel alike (`--lib accelerate` or `--lib accel`).

A small transformer-like model (residual blocks wrapped by class name), AdamW, gradient
accumulation and clipping, a sharded checkpoint half-way (`save_state`), then the rest of the
training. With `--resume_from DIR` it loads that checkpoint (written by either library) and
trains the second half only. Rank 0 saves the final full weights (`get_state_dict`) to
`--out/weights.pt` and prints one `RESULT {...}` line (JSON) with the losses.
"""

import argparse
import importlib
import json
import os

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--lib", choices=["accelerate", "accel"], required=True)
parser.add_argument("--mixed_precision", default="no")
parser.add_argument("--state_dict_type", default="SHARDED_STATE_DICT")
parser.add_argument("--resume_from", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--model", choices=["blocks", "gpt2"], default="blocks")
parser.add_argument(
    "--plugin_from_launcher", action="store_true", help="no plugin: `launch --use_fsdp --fsdp_*` sets it"
)
args = parser.parse_args()

lib = importlib.import_module(args.lib)
utils = importlib.import_module(f"{args.lib}.utils")

WIDTH, STEPS, HALF, PER_RANK = 16, 8, 4, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def gpt2():
    """A tiny GPT-2 built from its config (nothing downloaded): tied embeddings, `_no_split_modules` GPT2Block."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, attn_pdrop=0.0)
    config.resid_pdrop = config.embd_pdrop = 0.0
    return GPT2LMHeadModel(config)


plugin = utils.FullyShardedDataParallelPlugin(
    fsdp_version=2,
    auto_wrap_policy="transformer_based_wrap",
    # GPT-2: the model's own _no_split_modules (GPT2Block)
    transformer_cls_names_to_wrap=["Block"] if args.model == "blocks" else None,
    state_dict_type=args.state_dict_type,
)
if args.plugin_from_launcher:
    plugin = None
accelerator = lib.Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=2, fsdp_plugin=plugin)
torch.manual_seed(0)
model = Net() if args.model == "blocks" else gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)

world, rank = accelerator.num_processes, accelerator.process_index
generator = torch.Generator().manual_seed(1)
x = torch.randn(STEPS, world * PER_RANK, 4, generator=generator)
y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).tanh()


tokens = torch.randint(0, 64, (STEPS, world * PER_RANK, 16), generator=generator)


def compute_loss(step):
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    if args.model == "gpt2":
        ids = tokens[step, mine].to(accelerator.device)
        return model(input_ids=ids, labels=ids).loss.float()
    inputs, targets = x[step, mine].to(accelerator.device), y[step, mine].to(accelerator.device)
    return nn.functional.mse_loss(model(inputs).float(), targets)


def run(steps):
    losses = []
    for step in steps:
        with accelerator.accumulate(model):
            loss = compute_loss(step)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


if args.resume_from:
    accelerator.load_state(args.resume_from)
    losses = run(range(HALF, STEPS))
else:
    losses = run(range(HALF))
    accelerator.save_state(os.path.join(args.out, "checkpoint"))
    losses += run(range(HALF, STEPS))
weights = {k: v.detach().float().cpu() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    os.makedirs(args.out, exist_ok=True)
    torch.save(weights, os.path.join(args.out, "weights.pt"))
    result = {
        "distributed_type": str(accelerator.distributed_type),
        "param_type": type(next(model.parameters())).__name__,
        "losses": losses,
    }
    print("RESULT " + json.dumps(result))
accelerator.wait_for_everyone()
