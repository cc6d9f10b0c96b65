"""Ops a GPU runs with some of their tensor arguments on the host: packed sequences and CTC lengths.

A simulated GPU checks that an op's tensors share one device, as the code torch generates
for a CUDA kernel does. Two ops of the recurrent and speech stacks take host tensors by
contract, and reach the simulator by paths a GPU's plain tensors do not take:

* `_pack_padded_sequence(input, lengths)` (`pack_padded_sequence`): `lengths` is a CPU
  tensor, and so is the `batch_sizes` it returns. Its kernel is a composite with no device
  check, so it runs as on a GPU: its composite kernel, through the dispatcher, on the
  simulated tensors (`batch_sizes` stays on the host).
* `torch.ctc_loss` (`F.ctc_loss`) with lengths given as tensors: on a GPU, a plain tensor's
  `ctc_loss` reads the lengths into lists at once and runs the `int[]` overloads; a tensor
  subclass takes a composite path instead, which divides the losses on the GPU by the
  target lengths on the host and fails. In a simulated GPU rank `torch.ctc_loss` reads
  tensor lengths into lists first, as a GPU's tensors have it done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.cuda.tensors.cuda_tensor import is_simulated_cuda

aten = torch.ops.aten


def _lengths(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def pack_padded_sequence(args: tuple, kwargs: dict) -> Any:
    """`_pack_padded_sequence`: its composite kernel on the simulated tensors (lengths, batch sizes on the host)."""
    return torch_internals.run_composite(aten._pack_padded_sequence.default, args, kwargs)


def _ctc_loss_reading_lengths(ctc_loss: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(ctc_loss)
    def wrapper(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, *rest: Any, **kw: Any) -> Any:
        if is_simulated_cuda(log_probs):
            input_lengths, target_lengths = _lengths(input_lengths), _lengths(target_lengths)
        return ctc_loss(log_probs, targets, input_lengths, target_lengths, *rest, **kw)

    return wrapper


def handlers() -> dict[Any, Any]:
    """These ops -> their handlers on simulated CUDA tensors (`cuda_tensor.add_special`)."""
    return {
        aten._pack_padded_sequence.default: pack_padded_sequence,
    }


def install() -> None:
    """Have `torch.ctc_loss` read tensor lengths into lists for simulated GPUs (once per simulated GPU rank)."""
    if not hasattr(torch.ctc_loss, "__wrapped__"):
        torch.ctc_loss = _ctc_loss_reading_lengths(torch.ctc_loss)
