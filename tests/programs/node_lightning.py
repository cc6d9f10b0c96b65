"""A Lightning Trainer script started with plain `python`: Lightning starts its other rank itself.

`Trainer(accelerator="gpu", devices=2, strategy="ddp")` on a machine with 2 GPUs runs the
script again for rank 1 (Lightning's subprocess launcher) and trains with DDP, one GPU per
rank. On a simulated node (tests/test_sim_node_suites.py) both processes are the node's.
Each rank writes `RESULT {json}`: what it ran on and its trained weights; rank 0 adds the
reference, the same steps in plain torch on the CPU in one process: the script's sampler
gives rank r the samples r, r+2, ... in order, so a step of the 2 ranks is a step on 8
consecutive samples, and DDP's averaged gradient is theirs.
"""

import json
import os

import lightning as L
import torch

STEPS = 4
PER_RANK = 4


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * PER_RANK * 2, 4, generator=generator)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def flat(net: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in net.parameters()]).tolist()


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.devices_seen: set[str] = set()
        self.wrappers: set[str] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.devices_seen.add(str(x.device))
        self.wrappers.add(type(self.trainer.strategy.model).__name__)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        # in order, so that the reference can take the same samples (Lightning's own sampler shuffles)
        sampler = torch.utils.data.DistributedSampler(
            dataset(), num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return torch.utils.data.DataLoader(dataset(), batch_size=PER_RANK, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def reference() -> list[float]:
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = dataset().tensors
    for step in range(STEPS):
        batch = slice(step * 2 * PER_RANK, (step + 1) * 2 * PER_RANK)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
        optimizer.step()
    return flat(net)


if __name__ == "__main__":
    model = Regression()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "root_device": str(trainer.strategy.root_device),
        "devices_seen": sorted(model.devices_seen),
        "strategy": type(trainer.strategy).__name__,
        "wrappers": sorted(model.wrappers),
        "device_count": torch.cuda.device_count(),
        "global_step": trainer.global_step,
        "local_rank_env": os.environ.get("LOCAL_RANK"),
        "node": os.environ.get("ACCEL_SIM_NODE"),
        "pid": os.getpid(),
        "weights": flat(model.net),
    }
    if trainer.is_global_zero:
        result["reference"] = reference()
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the ranks share the pipe
