"""A Lightning Trainer script, as its users write one for a GPU node.

It runs unchanged on GPUs (`torchrun` / `accel launch --simulate cuda`) and on CPU ranks
(`accel launch --simulate cpu`): it picks `accelerator="cuda"` when CUDA is available and
"cpu" otherwise, and takes as many devices as torchrun's `LOCAL_WORLD_SIZE`, one node.

Fits a small MLP on synthetic regression data for two epochs with DDP or FSDP (full state
dict checkpoints, Lightning's default), validating after each epoch; one `ModelCheckpoint`
keeps the best epoch by validation loss, another every epoch and `last.ckpt`. Then it
validates the best checkpoint with a new Trainer (`validate(ckpt_path=...)`, which loads it). Prints,
from rank 0, one JSON line per training step (`STEP {"step": i, "loss": ...}`, the loss
averaged over the ranks), one per validation (`VAL {...}`) and one `RESULT {...}` line;
every rank prints `CHECKSUM {...}` with a checksum of its full (unsharded) parameters.

FSDP on CPU ranks: as in `lightning_fabric_train.py`, a subclass of `FSDPStrategy` that on
a CPU wraps the module itself with `device_id=cpu` (Lightning refuses FSDP on CPUs).
"""

import argparse
import hashlib
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed.fsdp import FullyShardedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
parser.add_argument("--precision", default="32-true")
parser.add_argument("--wrap", action="store_true", help="FSDP: each Linear its own unit")
parser.add_argument("--out", required=True)
args = parser.parse_args()

WRAPPERS = {"_forward_module", "_original_module", "_fsdp_wrapped_module", "module"}


class Sharded(FSDPStrategy):
    """Lightning's FSDPStrategy, which on GPUs does all it does; on CPU ranks it wraps with `device_id=cpu`."""

    def _setup_model(self, model):
        if self.root_device.type == "cpu":
            model = FullyShardedDataParallel(
                model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self.kwargs,
            )
        return super()._setup_model(model)


def checksum(parameters):
    digest = hashlib.sha256()
    for name in sorted(parameters):
        digest.update(name.encode())
        digest.update(parameters[name].float().contiguous().numpy().tobytes())
    total = sum(float(p.double().sum()) for p in parameters.values())
    return {"sha256": digest.hexdigest()[:16], "sum": total}


def full_parameters(wrapped, module):
    """`module`'s parameters by their names in the bare model, gathered in full on every rank (FSDP), on the host."""
    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
        return {
            ".".join(part for part in name.split(".") if part not in WRAPPERS): p.detach().float().cpu().clone()
            for name, p in module.named_parameters()
        }


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.output_dtypes, self.param_devices, self.wrappers = set(), set(), set()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        output = self(x)
        self.output_dtypes.add(str(output.dtype))
        self.param_devices.add(str(next(self.parameters()).device))
        self.wrappers.add(type(self.trainer.strategy.model).__name__)
        loss = torch.nn.functional.mse_loss(output, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Recorder(L.Callback):
    """Prints the loss of each step averaged over the ranks, and each validation's loss, from rank 0."""

    def __init__(self):
        self.losses, self.val_losses = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item()
        self.losses.append(loss)
        rank_zero_only(print)("STEP " + json.dumps({"step": trainer.global_step - 1, "loss": loss}), flush=True)

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        loss = trainer.callback_metrics["val_loss"].item()
        self.val_losses.append(loss)
        rank_zero_only(print)("VAL " + json.dumps({"epoch": trainer.current_epoch, "loss": loss}), flush=True)


def data(samples, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 8, generator=generator)
    targets = torch.sin(inputs @ torch.randn(8, 1, generator=torch.Generator().manual_seed(1)))
    return torch.utils.data.TensorDataset(inputs, targets)


L.seed_everything(0)
model = Regression()
train = torch.utils.data.DataLoader(data(256, 2), batch_size=8, shuffle=True)
val = torch.utils.data.DataLoader(data(64, 3), batch_size=8)

accelerator = "cuda" if torch.cuda.is_available() else "cpu"
devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def make_strategy():
    if args.strategy == "fsdp":
        return Sharded(auto_wrap_policy={torch.nn.Linear} if args.wrap else None, state_dict_type="full")
    return DDPStrategy()


strategy = make_strategy()
best = ModelCheckpoint(dirpath=args.out, filename="best", monitor="val_loss", mode="min", save_top_k=1)
every = ModelCheckpoint(dirpath=args.out, filename="{epoch}", save_top_k=-1, save_last=True)
recorder = Recorder()
trainer = L.Trainer(
    accelerator=accelerator,
    devices=devices,
    num_nodes=1,
    strategy=strategy,
    precision=args.precision,
    max_epochs=2,
    limit_train_batches=4,
    limit_val_batches=2,
    num_sanity_val_steps=0,
    callbacks=[best, every, recorder],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, train, val)

trained = checksum(full_parameters(trainer.strategy.model, model))
print("CHECKSUM " + json.dumps({"rank": trainer.global_rank, **trained}), flush=True)
best_path, best_score, last_path = best.best_model_path, float(best.best_model_score), every.last_model_path
device = trainer.strategy.root_device
ranks_devices = trainer.strategy.all_gather(torch.tensor([trainer.global_rank, device.index or 0], device=device))
# The best checkpoint validated by a new Trainer and model, as an evaluation script does
# (FSDP1 cannot wrap the fitted module a second time: its parameters are flattened already).
evaluator = L.Trainer(
    accelerator=accelerator,
    devices=devices,
    num_nodes=1,
    strategy=make_strategy(),
    precision=args.precision,
    limit_val_batches=2,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
(validated,) = evaluator.validate(Regression(), val, ckpt_path=best_path, verbose=False)

if trainer.is_global_zero:
    locations = set()  # where the file says each tensor was saved: cuda:0 from a GPU
    last = torch.load(last_path, map_location=lambda storage, at: locations.add(at) or storage, weights_only=False)
    result = {
        "world_size": trainer.world_size,
        "device": str(trainer.strategy.root_device),
        "param_devices": sorted(model.param_devices),
        "ranks_devices": ranks_devices.tolist(),
        "wrappers": sorted(model.wrappers),
        "strategy": type(trainer.strategy).__name__,
        "precision": type(trainer.strategy.precision_plugin).__name__,
        "output_dtypes": sorted(model.output_dtypes),
        "losses": recorder.losses,
        "val_losses": recorder.val_losses,
        "trained": trained,
        "last_checkpoint": checksum(last["state_dict"]),
        "last_checkpoint_step": last["global_step"],
        "last_checkpoint_locations": sorted(locations),
        "best": os.path.basename(best_path),
        "best_score": best_score,
        "validated_best": validated["val_loss"],
        "files": sorted(os.listdir(args.out)),
    }
    print("RESULT " + json.dumps(result), flush=True)
