"""Compiled regions that run op by op here, timed as Inductor's kernels run on the card.

Some regions `torch.compile` compiles are not modelled as Inductor's graphs by the memory model
(`accel.sim.core.compiled_buffers`: activation checkpointing, DTensor inputs, ...): they run as
eager code, op by op. On the card Inductor still compiles them, so their memory-bound ops run
fused. While such a region runs (its forward, and in backward each autograd node its forward
made), memory-bound ops join one pending kernel instead of each launching its own:

* it reads each tensor from outside the kernel once, and nothing a kernel op wrote before;
* it writes what outlives the kernel: results still referenced when the kernel ends (saved for
  backward, returned, held by the program) or read by the op that ends it;
* it ends (is launched, one kernel, by those bytes) where Inductor's kernel would: at a kernel
  it does not generate (matmul, attention, a collective), a host wait, a stream change, or
  when the region is left.

This is coarser than Inductor's scheduler (one kernel between two matmuls, where Inductor may
make two around a reduction), and finer than nothing: a compiled region here moves the bytes at
its kernels' boundaries, as on the card, not every intermediate.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.cuda.timing import costs
from accel.sim.cuda.timing.clock import Clock

#: the key of autograd nodes a region's forward made (in `Node.metadata`): their backward runs fused
MARK = "accel.sim.fused_region"

_depth = [0]  # compiled regions' forwards running now (nested regions count once)
_marked = [False]  # whether any region marked its backward nodes (then backward ops are checked)


class _Kernel:
    """The fused kernel being gathered: its GPU and stream, bytes read, results written."""

    def __init__(self, index: int, stream: int) -> None:
        self.where = (index, stream)
        self.read = 0
        self.keys: set[int] = set()  # storages read or written so far: read again for free
        self.written: dict[int, tuple[Any, int]] = {}  # storage -> (weak ref to the result, its bytes)


#: the kernel being gathered, if any
pending: list[_Kernel] = []
#: non-empty once a compiled region runs op by op in this process (only then are ops checked)
regions: list[bool] = []


def inside() -> bool:
    """Whether the op running now belongs to a compiled region run op by op (forward or backward)."""
    if _depth[0]:
        return True
    if not _marked[0]:
        return False
    node = torch_internals.current_autograd_node()
    return node is not None and MARK in node.metadata


def _key(tensor: torch.Tensor) -> int:
    inner = getattr(tensor, "_inner", tensor)  # a region's own results are the simulated tensors
    return torch_internals.storage_key(inner)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def add(clock: Clock, index: int, stream: int, args: Any, out: Any) -> None:
    """A memory-bound op of a fused region ran on (GPU `index`, `stream`): it joins the pending kernel."""
    if pending and pending[0].where != (index, stream):
        flush(clock)
    if not pending:
        pending.append(_Kernel(index, stream))
    kernel = pending[0]
    for tensor in _tensors(args):
        key = _key(tensor)
        if key not in kernel.keys:
            kernel.keys.add(key)
            kernel.read += costs.nbytes(tensor)
    for tensor in _tensors(out):
        key = _key(tensor)
        kernel.keys.add(key)
        kernel.written[key] = (weakref.ref(tensor), costs.nbytes(tensor))


def flush(clock: Clock, reader: Any = ()) -> None:
    """Launch the pending kernel, if any: it wrote what is still referenced or what `reader` (an op's
    arguments) reads."""
    if not pending:
        return
    kernel = pending.pop()
    read_now = {_key(t) for t in _tensors(reader)}
    written = sum(n for key, (ref, n) in kernel.written.items() if key in read_now or ref() is not None)
    index, stream = kernel.where
    clock.launch(index, stream, costs.moved(clock.card, kernel.read + written), name="fused kernel (compiled)")


def region(forward: Callable[..., Any], clock: Callable[[], Clock | None]) -> Callable[..., Any]:
    """`forward` of a compiled region that runs op by op, timed as fused (see the module's text)."""

    def fused_forward(*args: Any) -> Any:
        _depth[0] += 1
        try:
            out = forward(*args)
        finally:
            _depth[0] -= 1
        running = clock()
        if not _depth[0] and running is not None:
            flush(running, out)
            _mark_backward(out, args)
        return out

    return fused_forward


def _mark_backward(outputs: Any, inputs: Any) -> None:
    """Mark the autograd nodes between the region's outputs and its inputs: their backward runs fused."""
    stop = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
    todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        metadata: dict = node.metadata  # type: ignore[assignment]  # a property, typed as a method by torch's stubs
        if node in stop or type(node).__name__ == "AccumulateGrad" or MARK in metadata:
            continue
        metadata[MARK] = True
        _marked[0] = True
        todo.extend(next_node for next_node, _ in node.next_functions if next_node is not None)


def reset() -> None:
    """Forget what is pending (a new clock starts)."""
    pending.clear()
    _depth[0] = 0
