"""`AcceleratedScheduler`: a learning-rate scheduler that follows the optimizer's real steps.

A schedule is written for one process taking one optimizer step per batch. The wrapper
keeps that schedule's length whatever the setup:

- it does not advance when the optimizer did not step (inside an accumulation window,
  or a step the fp16 scaler skipped);
- without `split_batches`, each step of N processes consumes N batches of the
  one-process run, so it advances N times.

Under gradient accumulation it therefore advances N times per optimizer step, as
Accelerate 1.15 does: a schedule is sized in optimizer steps (times N). Accelerate's
`adjust_scheduler` only ever touches a private counter of torch's scheduler and never
the learning rate (in 1.15 its default value does not even reach the scheduler), so it
changes nothing here either; see docs/compat.md.
"""

from __future__ import annotations

from typing import Any

from accel.state import AcceleratorState, GradientState


class AcceleratedScheduler:
    """Wrap `scheduler` so that it steps only when the optimizer(s) really stepped.

    Args:
        scheduler: the torch learning-rate scheduler.
        optimizers: the optimizer, or list of optimizers, whose steps it follows.
        step_with_optimizer: follow the optimizer's steps (False: `step()` always steps once).
        split_batches: batches are split across processes (one step = one batch of the
            one-process run), so do not multiply steps by the number of processes.
    """

    def __init__(
        self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True, split_batches: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self.gradient_state = GradientState()
        self._processes_factor = 1 if split_batches else AcceleratorState().num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule once per process (once with `split_batches`) if the optimizer really stepped."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        for opt in self.optimizers:
            if getattr(opt, "step_was_skipped", False):
                return
        total_steps = getattr(self.scheduler, "total_steps", None)
        for _ in range(self._processes_factor):
            # Schedules with a fixed length (OneCycleLR) raise past their end: stop there.
            if total_steps is not None and self.scheduler.last_epoch >= total_steps:
                break
            self.scheduler.step(*args, **kwargs)

    # -- forwarding to the wrapped scheduler (same meaning as on torch's schedulers) ----

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def print_lr(self, *args: Any, **kwargs: Any) -> None:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here: anything else the scheduler offers.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
