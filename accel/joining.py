"""Training with uneven inputs: ranks with fewer batches wait for the others instead of hanging.

Where the hardware wraps models in `DistributedDataParallel` (the backend's
`supports_join()` is True), PyTorch's own `Join` context does it: a rank that ran out
of batches shadows the collectives of the others' forward and backward passes.

Where it does not (XLA: no DDP; gradients are reduced inside the backend's
`optimizer_step`), accel joins the optimizer step itself with the same `Join`
machinery: every real step first tells the join context that this rank is still
training, and a rank that ran out of batches answers each such step of the others by
taking a step with zero gradients. Its gradient reduction then matches theirs, so
nobody hangs; it receives the same averaged gradients and applies the same update, so
its model stays identical to the others'. The averaged gradients are, as with DDP's
join, divided by the full number of processes. Constraint of this fallback: every
prepared optimizer steps once per training step, in the order they were prepared.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook


def _make_step_joinable(optimizers: Sequence[Any], hardware: Any) -> Any:
    """A `Joinable` whose shadow of one training step is a zero-gradient step of each optimizer."""

    class _ShadowStep(JoinHook):
        def main_hook(self) -> None:
            for opt in optimizers:
                inner = opt.optimizer
                for group in inner.param_groups:
                    for param in group["params"]:
                        if param.requires_grad:
                            param.grad = torch.zeros_like(param)
                hardware.optimizer_step(inner)
                inner.zero_grad(set_to_none=True)

    class OptimizerStepJoinable(Joinable):
        def __init__(self) -> None:
            super().__init__()

        def join_hook(self, **kwargs: Any) -> Any:
            return _ShadowStep()

        @property
        def join_device(self) -> torch.device:
            # The join bookkeeping is a CPU tensor on a Gloo-capable group.
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            return hardware.object_group()

    return OptimizerStepJoinable()


@contextlib.contextmanager
def join_optimizer_steps(optimizers: Sequence[Any], hardware: Any) -> Iterator[None]:
    """Join uneven inputs at the optimizer step (for hardware without DDP join, see module doc)."""
    if not optimizers:
        # Accelerate proceeds here (its join has no effect off DDP): so do we, saying what is not joined.
        warnings.warn(
            "join_uneven_inputs on this hardware joins at the optimizer step, and no optimizer was prepared: it has "
            "no effect, and ranks with fewer batches may hang the others at their next collective. Prepare the "
            "optimizer with Accelerator.prepare() to join uneven inputs.",
            stacklevel=3,
        )
        yield
        return
    joinable = _make_step_joinable(optimizers, hardware)
    first = optimizers[0]

    def notify(optimizer: Any) -> None:
        # One notification per training step: when the first optimizer steps.
        if optimizer is first:
            work = Join.notify_join_context(joinable)
            if work is not None:
                work.wait()

    for opt in optimizers:
        opt._join_notify = notify
    try:
        with Join([joinable]):
            yield
    finally:
        for opt in optimizers:
            opt._join_notify = None


@contextlib.contextmanager
def join_ddp_models(models: Sequence[Any], **join_kwargs: Any) -> Iterator[None]:
    """PyTorch's `Join` over the prepared models that support it (DistributedDataParallel).

    Given none (a model that is not DistributedDataParallel), it warns and joins
    nothing, as Accelerate does where it cannot join: ranks with fewer batches may then
    hang the others at their next collective.
    """
    joinables = [m for m in models if isinstance(m, Joinable)]
    if not joinables:
        warnings.warn(  # "only supported for multi-GPU": Accelerate's words, which its scripts check
            "join_uneven_inputs joins DistributedDataParallel models (prepared with Accelerator.prepare() on several "
            "processes) and none was given: joining is only supported for multi-GPU (or multi-CPU) DDP training, so "
            "it has no effect here. Pass the prepared model.",
            stacklevel=3,
        )
        yield
        return
    with Join(joinables, **join_kwargs):
        yield


@contextlib.contextmanager
def override_even_batches(loaders: Sequence[Any], even_batches: bool | None) -> Iterator[None]:
    """Set `even_batches` on the batch samplers of `loaders` for the block, then restore it.

    Loaders without such a batch sampler (iterable datasets, dispatched batches) keep
    their behaviour, with a warning, as in Accelerate.
    """
    if even_batches is None:
        yield
        return
    samplers = []
    skipped = []
    for loader in loaders:
        sampler: Any = getattr(loader, "batch_sampler", None)
        if hasattr(sampler, "even_batches"):
            samplers.append((sampler, sampler.even_batches))
        else:
            skipped.append(type(loader).__name__)
    if skipped:
        warnings.warn(
            # "only supported for map-style datasets": Accelerate's words, which its scripts check
            "join_uneven_inputs(even_batches=...): overriding even_batches is only supported for map-style datasets "
            f"that are not dispatched; left as they are: {', '.join(skipped)}",
            stacklevel=3,
        )
    for sampler, _ in samplers:
        sampler.even_batches = even_batches
    try:
        yield
    finally:
        for sampler, previous in samplers:
            sampler.even_batches = previous
