"""An Accelerate training script, `import accelerate` untouched, as its users write one.

Trains a small regression model with gradient accumulation, gathers predictions for
metrics, saves and reloads its state, and prints one `RESULT {...}` line (JSON) from
the main process. Run it under `accel launch --simulate cuda` (or cpu) with
`--mixed_precision` and optionally `--fsdp2`.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--mixed_precision", default="no")
parser.add_argument("--fsdp2", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT") if args.fsdp2 else None
accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=args.mixed_precision, fsdp_plugin=plugin)
state = PartialState()  # the shared state Accelerator set up
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(0)
x = torch.randn(96, 4, generator=generator)
data = torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
train = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=generator)
evaluation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0)[:, None]), batch_size=4)
model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)

losses = []
for _epoch in range(2):
    for inputs, targets in train:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())

seen = torch.cat([accelerator.gather_for_metrics(batch) for (batch,) in evaluation])
ranks = accelerator.gather(torch.tensor([accelerator.process_index], device=accelerator.device))
path = os.path.join(args.out, "state")
accelerator.save_state(path)
accelerator.wait_for_everyone()
before = {k: v.detach().float().cpu() for k, v in accelerator.get_state_dict(model).items()}
accelerator.load_state(path)
after = {k: v.detach().float().cpu() for k, v in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    result = {
        "device": str(accelerator.device),
        "state_device": str(state.device),
        "distributed_type": str(accelerator.distributed_type),
        "param_type": type(next(model.parameters())).__name__,
        "losses": losses,
        "seen": seen.flatten().tolist(),
        "ranks": ranks.tolist(),
        "reloaded_equal": all(torch.equal(before[k], after[k]) for k in before),
    }
    print("RESULT " + json.dumps(result))
accelerator.end_training()
