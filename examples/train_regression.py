"""Fit a linear regression with accel: the same script on one CPU, N processes, GPUs or a TPU.

    python examples/train_regression.py                                     # one process
    accel launch --simulate cuda --num_processes 4 examples/train_regression.py
    accel launch --num_processes 2 examples/train_regression.py --mixed_precision bf16

The data are y = 2·x₀ − 3·x₁ + 1 + noise. The script prints the distributed setup,
the training loss and evaluation error of each epoch (over every process), and checks
that the learned weights are the true ones; it exits with status 1 if they are not.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.utils import set_seed

TRUE_WEIGHT = (2.0, -3.0)
TRUE_BIAS = 1.0


def make_dataset(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    y = x @ torch.tensor(TRUE_WEIGHT)[:, None] + TRUE_BIAS + 0.05 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.gradient_accumulation_steps
    )
    accelerator.print(f"== accel: {accelerator.num_processes} process(es) on {accelerator.distributed_type}")
    accelerator.print(accelerator.state, end="")
    accelerator.print(f"Gradient accumulation steps: {accelerator.gradient_accumulation_steps}\n")

    set_seed(42)
    train_loader = DataLoader(make_dataset(1024, seed=0), batch_size=args.batch_size, shuffle=True)
    # 250 samples: the last evaluation batch is uneven, gather_for_metrics drops the padding
    eval_set = make_dataset(250, seed=1)
    eval_loader = DataLoader(eval_set, batch_size=args.batch_size)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=len(train_loader) * 4, gamma=0.3)
    model, optimizer, scheduler, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, eval_loader
    )

    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros((), device=accelerator.device)
        for inputs, targets in train_loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            loss_sum += loss.detach()
        train_loss = accelerator.reduce(loss_sum / len(train_loader), reduction="mean")

        model.eval()
        predictions, references = [], []
        with torch.no_grad():
            for inputs, targets in eval_loader:
                preds, refs = accelerator.gather_for_metrics((model(inputs), targets))
                predictions.append(preds)
                references.append(refs)
        predictions, references = torch.cat(predictions), torch.cat(references)
        eval_mse = torch.nn.functional.mse_loss(predictions, references).item()
        accelerator.print(
            f"epoch {epoch}: train loss {train_loss.item():.5f}  eval mse {eval_mse:.5f} "
            f"on {len(predictions)} samples  lr {scheduler.get_last_lr()[0]:.4f}"
        )

    accelerator.wait_for_everyone()
    learned = accelerator.unwrap_model(model)
    weight = learned.weight.detach().cpu().reshape(-1).tolist()
    bias = learned.bias.item()
    ok = (
        all(abs(w - t) < 0.05 for w, t in zip(weight, TRUE_WEIGHT, strict=True))
        and abs(bias - TRUE_BIAS) < 0.05
        and len(predictions) == len(eval_set)
    )
    accelerator.print(
        f"learned y = {weight[0]:.3f}·x0 + {weight[1]:.3f}·x1 + {bias:.3f}   "
        f"(true: {TRUE_WEIGHT[0]}·x0 + {TRUE_WEIGHT[1]}·x1 + {TRUE_BIAS})"
    )
    accelerator.print("result check: OK" if ok else "result check: FAILED")
    accelerator.end_training()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
