"""What `ACCEL_SIMULATE` asks for: the simulated node a process tree runs on.

Forms: ``cuda:N`` (N simulated GPUs, the default card), ``cuda:N,gpu=L4`` (a card of
`accel.sim.cuda.gpus.cards`, or one described: ``gpu=memory=24GiB,capability=8.9``),
``cuda:N,shapes_only`` (tensors hold shapes, not values), options combined with commas, and
``xla:N`` (N simulated TPU cores). Anything else is refused naming the variable and these forms.
Torch-free: it is read at interpreter start-up.
"""

from __future__ import annotations

import dataclasses

#: the variable that puts a process tree on a simulated node
from accel.sim.cuda.gpus import cards as gpu_models

ENV = "ACCEL_SIMULATE"
FORMS = "cuda:N, cuda:N,gpu=NAME, cuda:N,shapes_only (options combine: cuda:N,gpu=L4,shapes_only) or xla:N"
DEVICES = ("cuda", "xla")


class SimulateSpecError(ValueError):
    """`ACCEL_SIMULATE` names no node the simulator can make."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """A simulated node: its device kind, how many of them, the GPUs' card, shapes only."""

    device: str
    count: int
    gpu: str | None = None
    shapes_only: bool = False

    def __str__(self) -> str:
        options = [f"gpu={self.gpu}"] if self.gpu else []
        options += ["shapes_only"] if self.shapes_only else []
        return ",".join([f"{self.device}:{self.count}", *options])


#: the words of a card described by its figures (`gpu_models`), which carry on past a comma
_CARD_WORDS = ("memory", "capability", "name", "sms")


def _refuse(value: str, why: str, subject: str | None) -> SimulateSpecError:
    return SimulateSpecError(f"{subject or f'{ENV}={value!r}'}: {why}; use {FORMS}")


def parse(value: str, subject: str | None = None) -> NodeSpec:
    """The node `value` asks for; `SimulateSpecError` says what is wrong (naming `subject`, default the variable)."""
    head, *options = [part.strip() for part in value.strip().split(",")]
    device, _, count_text = head.partition(":")
    device = device.lower()
    if device not in DEVICES:
        raise _refuse(value, f"unknown device {device!r} (a TPU is 'xla')", subject)
    if not count_text.isdigit() or int(count_text) < 1:
        raise _refuse(value, f"the number of devices must be a whole number of at least 1, got {count_text!r}", subject)
    gpu: str | None = None
    shapes_only = False
    for option in options:
        name, _, setting = option.partition("=")
        if name == "shapes_only" and not setting:
            shapes_only = True
        elif name == "gpu" and setting:
            gpu = setting
        elif gpu is not None and "=" in gpu and name in _CARD_WORDS and setting:
            gpu = f"{gpu},{option}"  # gpu=memory=24GiB,capability=8.9: one card, described
        else:
            raise _refuse(value, f"unknown option {option!r}", subject)
    if device != "cuda" and (gpu or shapes_only):
        raise _refuse(value, "gpu= and shapes_only apply to simulated GPUs (cuda) only", subject)
    if gpu is not None:
        try:
            gpu_models.resolve(gpu)
        except ValueError as error:
            raise _refuse(value, str(error), subject) from None
    return NodeSpec(device, int(count_text), gpu, shapes_only)
