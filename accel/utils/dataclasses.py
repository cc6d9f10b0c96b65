"""Enums, kwargs handlers and configuration dataclasses of the public API."""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    """A string-valued enum that compares equal to its value (``DistributedType.NO == "NO"``)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class DistributedType(_StrEnum):
    """How the current run is distributed."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"


class RNGType(_StrEnum):
    """Random number generators that can be synchronised across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    XLA = "xla"
    GENERATOR = "generator"


class PrecisionType(_StrEnum):
    """Mixed-precision modes accepted by ``Accelerator(mixed_precision=...)``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"
