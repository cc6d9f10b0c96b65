"""`accel.inference`: Accelerate's pipeline-parallel inference (`prepare_pippy`) is refused by name.

accel runs data parallelism (DDP, FSDP2) and big-model dispatch; pipeline parallelism through
`torch.distributed.pipelining` is not offered. For a model larger than one device, use a device map
(`accel.big_modeling.load_checkpoint_and_dispatch`, `dispatch_model`); for pipelining, Hugging Face
Accelerate itself.
"""

from __future__ import annotations

from typing import Any

PIPPY_REFUSED = (
    "prepare_pippy (pipeline-parallel inference through torch.distributed.pipelining) is not supported by accel, "
    "which runs data parallelism (DDP, FSDP2) only. For a model larger than one device use a device map "
    "(accel.big_modeling.load_checkpoint_and_dispatch / dispatch_model), or run this script with Hugging Face "
    "Accelerate itself."
)


def prepare_pippy(
    model: Any,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple[Any, ...] | None = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool | None = False,
) -> Any:
    """Refused: raises `NotImplementedError` naming what to use instead (see the module docstring)."""
    raise NotImplementedError(PIPPY_REFUSED)


__all__ = ["prepare_pippy"]
