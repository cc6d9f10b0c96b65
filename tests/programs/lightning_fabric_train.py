"""A Lightning Fabric training script, as its users write one for a GPU node.

It runs unchanged on GPUs (`torchrun` / `accel launch --simulate cuda`) and on CPU ranks
(`accel launch --simulate cpu`): it picks `accelerator="cuda"` when CUDA is available and
"cpu" otherwise, and takes as many devices as torchrun's `LOCAL_WORLD_SIZE`, one node.

Trains a small MLP on synthetic regression data with DDP or FSDP (one unit, or with
`--wrap` each Linear its own), gradients clipped, in the precision asked for; saves a
checkpoint with `fabric.save` (FSDP: sharded, through torch.distributed.checkpoint), takes
one more step, reloads the checkpoint with `fabric.load`, and reports the weights at each
point, so that a reload which restores nothing shows. Prints, from rank 0, one JSON line
per step (`STEP {"step": i, "loss": ...}`, the loss averaged over the ranks) and one
`RESULT {...}` line; every rank prints `CHECKSUM {...}` with a checksum of its full
(unsharded) parameters.

FSDP on CPU ranks (the reference run): Lightning refuses `FSDPStrategy` with the CPU
accelerator (an exact-type check), so the script passes a subclass, `Sharded`, which on a
GPU is Lightning's strategy unchanged and on a CPU wraps the module itself (see below).
"""

import argparse
import hashlib
import json
import os

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
parser.add_argument("--precision", default="32-true")
parser.add_argument("--wrap", action="store_true", help="FSDP: each Linear its own unit")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--out", required=True)
args = parser.parse_args()


class Sharded(FSDPStrategy):
    """Lightning's FSDPStrategy, which on GPUs does all it does; on CPU ranks it wraps with `device_id=cpu`.

    Lightning refuses `FSDPStrategy` itself with the CPU accelerator (an exact-type check), and
    passes FSDP `device_id=root_device.index`, None on a CPU, for which torch's FSDP looks for an
    accelerator. On CPU ranks this wraps the module as Lightning would, on the CPU, and Lightning
    then takes the wrapped module as it takes one its user wrapped.
    """

    def setup_module(self, module):
        if self.root_device.type == "cpu":
            module = FullyShardedDataParallel(
                module,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self._fsdp_kwargs,
            )
        return super().setup_module(module)


WRAPPERS = {"_forward_module", "_original_module", "_fsdp_wrapped_module", "module"}


def full_parameters(module):
    """The module's parameters by their names in the bare model, gathered in full on every rank (FSDP), on the host."""
    with FullyShardedDataParallel.summon_full_params(module, writeback=False):
        return {
            ".".join(part for part in name.split(".") if part not in WRAPPERS): p.detach().float().cpu().clone()
            for name, p in module.named_parameters()
        }


def checksum(parameters):
    digest = hashlib.sha256()
    for name in sorted(parameters):
        digest.update(name.encode())
        digest.update(parameters[name].contiguous().numpy().tobytes())
    total = sum(float(p.double().sum()) for p in parameters.values())
    return {"sha256": digest.hexdigest()[:16], "sum": total}


accelerator = "cuda" if torch.cuda.is_available() else "cpu"
devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
if args.strategy == "fsdp":
    strategy = Sharded(auto_wrap_policy={torch.nn.Linear} if args.wrap else None, state_dict_type="sharded")
else:
    strategy = DDPStrategy()
fabric = L.Fabric(accelerator=accelerator, devices=devices, num_nodes=1, strategy=strategy, precision=args.precision)
fabric.launch()
fabric.seed_everything(0)

model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
)
generator = torch.Generator().manual_seed(1)
inputs = torch.randn(256, 8, generator=generator)
targets = torch.sin(inputs @ torch.randn(8, 1, generator=generator))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=8, shuffle=True)
# the dtype the last layer computes in (Fabric gives the caller its output back in float32)
dtypes = set()
model[-1].register_forward_hook(lambda module, inputs, output: dtypes.add(str(output.dtype)))

model = fabric.setup_module(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
optimizer = fabric.setup_optimizers(optimizer)
loader = fabric.setup_dataloaders(loader)


def train_step(x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    return fabric.all_reduce(loss.detach().float(), reduce_op="mean").item()


losses = []
batches = iter(loader)
for step in range(args.steps):
    x, y = next(batches)
    losses.append(train_step(x, y))
    fabric.print("STEP " + json.dumps({"step": step, "loss": losses[-1]}))

trained = checksum(full_parameters(model))
path = os.path.join(args.out, "fabric.ckpt")
fabric.save(path, {"model": model, "optimizer": optimizer, "step": args.steps})
x, y = next(batches)
train_step(x, y)  # moves the weights away from the checkpoint
moved = checksum(full_parameters(model))
state = {"model": model, "optimizer": optimizer}
remainder = fabric.load(path, state)
reloaded = checksum(full_parameters(model))

devices_seen = fabric.all_gather(torch.tensor([fabric.global_rank, fabric.device.index or 0], device=fabric.device))
print("CHECKSUM " + json.dumps({"rank": fabric.global_rank, **trained}), flush=True)
fabric.print(
    "RESULT "
    + json.dumps(
        {
            "world_size": fabric.world_size,
            "device": str(fabric.device),
            "strategy": type(fabric.strategy).__name__,
            "precision": type(fabric.strategy.precision).__name__,
            "wrapper": type(model._forward_module).__name__,
            "param_device": str(next(model.parameters()).device),
            "ranks_devices": devices_seen.tolist(),
            "output_dtypes": sorted(dtypes),
            "losses": losses,
            "trained": trained,
            "moved": moved,
            "reloaded": reloaded,
            "remainder": remainder,
        }
    )
)
