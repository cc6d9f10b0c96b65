"""Training that survives a crash: save_state every few steps, resume from the last one after a restart.

    accel launch --simulate cpu --num_processes 2 examples/train_resumable.py --output_dir /tmp/run
    # kill rank 1 at step 7 (mid-epoch); accel launch restarts every rank, which resume at step 5:
    accel launch --simulate cpu --num_processes 2 --max_restarts 1 \\
        --fault kill:rank=1:point=step_7 examples/train_resumable.py --output_dir /tmp/run2

Both runs end with the same weights in OUTPUT_DIR/final.pt: the restarted one loads the
last complete checkpoint (`load_state`: model, optimizer, scheduler, RNG states) and
skips the batches of the epoch it had already trained on (`skip_first_batches`), and
the seedable sampler shuffles each epoch the same way in both runs. Under torchrun
(`accel launch --max_restarts N` on real hardware) it resumes the same way.

`accel.sim.fault_point(f"step_{n}")` marks the end of each step for injected faults; it
does nothing outside the simulator.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.sim import fault_point
from accel.utils import set_seed

#: a checkpoint folder is complete once every rank has written its part and this file exists
COMPLETE = "complete"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="checkpoints and final.pt go here")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save_every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--batch_size", type=int, default=4, help="per process")
    return parser.parse_args()


def make_dataset(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def latest_checkpoint(output_dir: str) -> tuple[str | None, int]:
    """The newest complete checkpoint folder and its step (None, 0 if there is none)."""
    steps = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            if name.startswith("step_") and os.path.exists(os.path.join(output_dir, name, COMPLETE)):
                steps.append(int(name.removeprefix("step_")))
    if not steps:
        return None, 0
    return os.path.join(output_dir, f"step_{max(steps)}"), max(steps)


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(use_seedable_sampler=True)
    set_seed(0)
    loader = DataLoader(make_dataset(), batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.5)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)

    checkpoint, step = latest_checkpoint(args.output_dir)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if checkpoint is not None:
        accelerator.load_state(checkpoint)
        accelerator.print(f"attempt {attempt}: resuming from {checkpoint} (step {step})")
    else:
        accelerator.print(f"attempt {attempt}: starting from scratch")

    first_epoch, done_in_epoch = divmod(step, len(loader))
    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if epoch == first_epoch else loader
        for inputs, targets in batches:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            fault_point(f"step_{step}")
            if step % args.save_every == 0:
                folder = os.path.join(args.output_dir, f"step_{step}")
                accelerator.save_state(folder)
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    open(os.path.join(folder, COMPLETE), "w").close()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f} (step {step})")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "final.pt"))
    accelerator.print(f"done after {step} steps")


if __name__ == "__main__":
    main()
