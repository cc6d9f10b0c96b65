"""One process driving several simulated GPUs: `torch.nn.parallel.comm` / `torch.cuda.comm`'s copies.

`nn.DataParallel` (and the Trainer, which wraps a model in it when one process sees several
GPUs) broadcasts the parameters to every GPU, scatters the batch and gathers the outputs
with these functions, which torch implements in its CUDA library (`torch._C._broadcast`,
`_scatter`, `_gather`, ...; a CPU build has none). Here they copy between simulated GPUs as
torch's C++ does (torch/csrc/cuda/comm.cpp): a tensor already on a target GPU is used
as is, scattered chunks are views where they need no copy, a gather writes into one result
on the destination. Torch's Python wrappers check the arguments first, as on a GPU host.
`broadcast_coalesced` copies each tensor on its own instead of through flat buffers of
`buffer_size` bytes, so the target GPUs hold the same bytes in more, smaller blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _gpu(index: int) -> torch.device:
    return torch.device("cuda", index)


def _source_index(tensor: torch.Tensor) -> int | None:
    return tensor.get_device() if tensor.is_cuda else None


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """`torch._C._broadcast`: `tensor` on each of `devices` (itself where it already is)."""
    source = _source_index(tensor)
    if source is not None and devices and devices[0] != source:
        raise RuntimeError(
            f"device of broadcasted tensor must appear as the first on devices list, got {source} and {devices[0]}"
        )
    return [tensor if index == source else tensor.to(_gpu(index), copy=True) for index in devices]


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`torch._C._broadcast_out`: `tensor` copied into each of `out`."""
    for target in out:
        if target.shape != tensor.shape:
            raise RuntimeError(
                f"Output tensor must have the same shape as the input tensor, got {list(target.shape)} and "
                f"{list(tensor.shape)}"
            )
        target.copy_(tensor)
    return list(out)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int) -> list[list[Any]]:
    """`torch._C._broadcast_coalesced`: the tensors (all on `devices[0]`) themselves, then copies on each other GPU."""
    del buffer_size  # copied one by one (see the module's text)
    for tensor in tensors:
        if _source_index(tensor) != devices[0]:
            raise RuntimeError(f"all tensors must be on devices[0]: {devices[0]}, but got a tensor on {tensor.device}")
    return [list(tensors)] + [[t.to(_gpu(index), copy=True) for t in tensors] for index in devices[1:]]


def scatter(
    tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Sequence[int] | None, dim: int, streams: Any
) -> list[torch.Tensor]:
    """`torch._C._scatter`: `tensor` cut along `dim` (into `chunk_sizes`, else evenly), a piece on each GPU."""
    if chunk_sizes is not None:
        if len(chunk_sizes) != len(devices):
            raise RuntimeError(
                f"Expected devices and chunk_sizes to be of same length, but got len(devices) = {len(devices)} and "
                f"len(chunk_sizes) = {len(chunk_sizes)}"
            )
        pieces = list(tensor.split(list(chunk_sizes), dim))
    else:
        pieces = list(tensor.chunk(len(devices), dim))
    return [piece.to(_gpu(index), non_blocking=True) for piece, index in zip(pieces, devices, strict=False)]


def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int, streams: Any) -> list[torch.Tensor]:
    """`torch._C._scatter_out`: `tensor` cut along `dim` into the sizes of `out`, copied into them."""
    sizes = [target.shape[dim] for target in out]
    if sum(sizes) != tensor.shape[dim]:
        raise RuntimeError(
            f"Total size for output tensors along scatter dim ({sum(sizes)}) does not match that of the input "
            f"tensor ({tensor.shape[dim]})"
        )
    for piece, target in zip(tensor.split(sizes, dim), out, strict=True):
        target.copy_(piece, non_blocking=True)
    return list(out)


def _gathered_shape(tensors: Sequence[torch.Tensor], dim: int) -> list[int]:
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    shape = list(tensors[0].shape)
    dim = dim % max(len(shape), 1)
    for i, tensor in enumerate(tensors[1:], 1):
        others = [size for d, size in enumerate(tensor.shape) if d != dim]
        if tensor.dim() != len(shape) or others != shape[:dim] + shape[dim + 1 :]:
            raise RuntimeError(
                f"Input tensor at index {i} has invalid shape {list(tensor.shape)}, but expected "
                f"{shape[:dim] + ['*'] + shape[dim + 1 :]}"
            )
    shape[dim] = sum(tensor.shape[dim] for tensor in tensors)
    return shape


def gather(tensors: Sequence[torch.Tensor], dim: int, destination: int | None) -> torch.Tensor:
    """`torch._C._gather`: the tensors joined along `dim` in one result on GPU `destination` (-1: the CPU)."""
    target = (
        torch.device("cpu")
        if destination == -1
        else _gpu(torch.cuda.current_device() if destination is None else destination)
    )
    result = torch.empty(_gathered_shape(tensors, dim), dtype=tensors[0].dtype, device=target)
    return gather_out(tensors, result, dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
    """`torch._C._gather_out`: the tensors joined along `dim`, written into `out`."""
    if list(out.shape) != _gathered_shape(tensors, dim):
        raise RuntimeError(f"Expected out tensor to have shape {_gathered_shape(tensors, dim)}, got {list(out.shape)}")
    start = 0
    for tensor in tensors:
        length = tensor.shape[dim]
        out.narrow(dim, start, length).copy_(tensor, non_blocking=True)
        start += length
    return out


#: the C++ entry points of `torch.nn.parallel.comm`, by name in `torch._C`
FUNCTIONS = {
    "_broadcast": broadcast,
    "_broadcast_out": broadcast_out,
    "_broadcast_coalesced": broadcast_coalesced,
    "_scatter": scatter,
    "_scatter_out": scatter_out,
    "_gather": gather,
    "_gather_out": gather_out,
}
