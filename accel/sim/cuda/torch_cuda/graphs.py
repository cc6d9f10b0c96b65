"""CUDA graphs on simulated GPUs: `torch.cuda.CUDAGraph`, `torch.cuda.graph`, `make_graphed_callables`.

A CPU build of torch has only a dummy `CUDAGraph` that refuses to be made, and a CUDA build's asks the
driver. Here a capture records every op that touches a simulated GPU (a dispatch mode, so ops inside
DTensor, collectives and autograd's backward are seen as the program issues them), and `replay()` runs
the record again on the same tensors, as the card re-launches the captured kernels on the same memory:
inputs the program refreshed in place are read again, outputs it holds are written again, in-place
updates (an optimizer's) happen again, random ops draw again. Tensors made during capture that the
program dropped are not kept (the card's private pool reuses their memory); replay makes them anew
without counting them, since a replay allocates nothing. On the clock, capture launches nothing on the
GPU and a replay's kernels are issued at once, for one launch's host cost.

As on the card, the host may not wait for the GPU while a capture is under way (`.item()`, blocking
copies, `torch.cuda.synchronize()`): that raises, and the capture fails at its end.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from accel.sim.core import torch_internals
from accel.sim.cuda.memory import allocator
from accel.sim.cuda.nccl import timed as nccl_timed
from accel.sim.cuda.tensors import sync_debug
from accel.sim.cuda.tensors.cuda_tensor import is_simulated_cuda, unwrap
from accel.sim.cuda.timing import clock as timing_clock

aten = torch.ops.aten

#: what the card says when the host waits for a capturing stream (cudaErrorStreamCaptureUnsupported)
NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"
#: what capture_end says after such an error (cudaErrorStreamCaptureInvalidated)
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"

_pool_ids = itertools.count(1)
#: the capture under way in this process (one at a time, as torch documents)
_active: list[CUDAGraph] = []


class _Made:
    """A tensor the capture made: replay gives it anew, by its number."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


def _on_gpu(values: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)


class _Recorder(TorchDispatchMode):
    """Records the ops of a capture that touch a simulated GPU."""

    def __init__(self, graph: CUDAGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        self.graph._keep_before_writing(_written(func, args, kwargs))
        out = self.graph._issue(func, args, kwargs)
        outputs = tree_flatten(out)[0]
        if _on_gpu(flat) or _on_gpu(outputs):
            self.graph._record(func, flat, spec, outputs, fresh=_fresh_outputs(func))
        return out


def _collective(call: Any, args: tuple, kwargs: dict) -> Any:
    """A collective of the simulated NCCL group issued while a capture is under way: recorded as one step
    (what it runs inside is its own business), unless it is issued by an op already recorded."""
    if not _active or _active[0]._inner:
        return call(*args, **kwargs)
    graph = _active[0]
    flat, spec = tree_flatten((args, kwargs))
    graph._keep_before_writing([v for v in flat if isinstance(v, torch.Tensor)])
    out = graph._issue(call, args, kwargs)
    graph._record(call, flat, spec, [out], fresh=False)
    return out


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors op `func` writes into (its schema's mutable arguments)."""
    found: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


def _fresh_outputs(func: Any) -> bool:
    """Whether op `func` returns new memory (not a view or an argument)."""
    return all(ret.alias_info is None for ret in func._schema.returns)


def _storage_of_any(value: Any) -> int | None:
    return _storage(value) if isinstance(value, torch.Tensor) else None


def _storage(tensor: torch.Tensor) -> int | None:
    """The identity of the GPU memory under `tensor` (None off the GPU)."""
    if is_simulated_cuda(tensor):
        return torch_internals.storage_key(unwrap(tensor))
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard's
    return _storage(local) if isinstance(local, torch.Tensor) else None


class CUDAGraph:
    """`torch.cuda.CUDAGraph` on simulated GPUs (module docstring): capture records, replay runs the record."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._keep_graph = keep_graph
        self._pool: tuple[int, int] = (next(_pool_ids), 0)
        self._steps: list[tuple[Any, list[Any], Any, list[int | None]]] = []
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self._recorder: _Recorder | None = None
        self._clock_before: tuple[dict, int, int] | None = None  # the GPUs' clock as the capture began
        self._captured = False
        self._failed = False
        self._debug = False
        self._inner = 0  # > 0 while a recorded op runs: what it issues itself is not recorded apart
        self._new_storages: set[int] = set()  # GPU memory the capture allocated
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # memory from before the capture, as it was

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **_: Any) -> None:
        """Begin capturing the work issued from here on (the current stream's, as on the card)."""
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"Unknown capture error mode: {capture_error_mode!r}")
        if _active:
            raise RuntimeError("a CUDA graph capture is already under way in this process: one at a time")
        self.reset()
        if pool is not None:
            self._pool = tuple(pool)
        _active.append(self)
        sync_debug.before_wait.append(refuse_wait_while_capturing)
        clock = timing_clock.current()
        self._clock_before = clock.gpu_state() if clock is not None else None
        self._recorder = _Recorder(self)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        """End the capture; the graph can be replayed from now on."""
        if self._recorder is None:
            raise RuntimeError("capture_end called without a capture_begin")
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        _active.remove(self)
        sync_debug.before_wait.remove(refuse_wait_while_capturing)
        self._put_back()
        clock = timing_clock.current()
        if clock is not None and self._clock_before is not None:
            clock.rewind_gpus(self._clock_before)  # capturing records kernels, the GPU runs none of them
        if self._failed:
            self.reset()
            raise RuntimeError(INVALIDATED)
        self._made = WeakIdKeyDictionary()
        self._captured = True

    def instantiate(self) -> None:
        """Nothing to build on a simulated GPU: the record is what replay runs."""
        self._require_capture("instantiate")

    def replay(self) -> None:
        """Run the captured work again on the same tensors."""
        self._require_capture("replay")
        clock = timing_clock.current()
        host = clock.host if clock is not None else 0.0
        allocator.pause()  # a replay allocates nothing: the tensors it makes anew are the pool's memory
        try:
            with torch.no_grad(), torch_internals.autocast_off():
                made: dict[int, torch.Tensor] = {}
                for func, template, spec, outputs in self._steps:
                    if clock is not None:
                        clock.host = host  # the graph's kernels are all issued by one launch
                    self._replay_step(func, template, spec, outputs, made)
        finally:
            allocator.resume()
        if clock is not None:
            clock.host = host + timing_clock.HOST_OP_S

    def reset(self) -> None:
        """Drop what was captured."""
        self._steps = []
        self._refs = []
        self._made = WeakIdKeyDictionary()
        self._captured = False
        self._failed = False

    def pool(self) -> tuple[int, int]:
        """The token of this graph's memory pool, which another capture may share."""
        return self._pool

    def enable_debug_mode(self) -> None:
        self._debug = True

    def debug_dump(self, debug_path: str) -> None:
        """Write the captured ops as a Graphviz graph, one node per op in issue order (after `enable_debug_mode`)."""
        if not self._debug:
            raise RuntimeError("CUDAGraph.debug_dump needs CUDAGraph.enable_debug_mode() before the capture")
        lines = ["digraph cuda_graph {"]
        for number, (func, *_rest) in enumerate(self._steps):
            lines.append(f'  n{number} [label="{func}"];')
            if number:
                lines.append(f"  n{number - 1} -> n{number};")
        lines.append("}")
        with open(debug_path, "w") as handle:
            handle.write("\n".join(lines) + "\n")

    def raw_cuda_graph(self) -> int:
        raise RuntimeError(_NO_DRIVER.format("raw_cuda_graph()"))

    def raw_cuda_graph_exec(self) -> int:
        raise RuntimeError(_NO_DRIVER.format("raw_cuda_graph_exec()"))

    def get_graph_data(self) -> dict:
        raise RuntimeError(_NO_DRIVER.format("get_graph_data()"))

    # -- capture and replay ------------------------------------------------------------------------------

    def _issue(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._inner += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._inner -= 1

    def _keep_before_writing(self, tensors: list[torch.Tensor]) -> None:
        """Capturing launches nothing on the card: memory that existed before it is left as it was, so what
        the capture computes into it now is undone at its end (`_put_back`)."""
        allocator.pause()
        try:
            with torch.no_grad():
                for tensor in tensors:
                    key = _storage(tensor)
                    if key is not None and key not in self._new_storages:
                        self._kept.append((tensor, tensor.detach().clone()))
        finally:
            allocator.resume()

    def _put_back(self) -> None:
        allocator.pause()
        try:
            with torch.no_grad(), torch_internals.autocast_off():
                for tensor, before in reversed(self._kept):
                    tensor.detach().copy_(before)
        finally:
            allocator.resume()
            self._kept = []
            self._new_storages = set()

    def _refuse_wait(self) -> None:
        self._failed = True
        raise RuntimeError(NOT_PERMITTED)

    def _record(self, func: Any, flat: list[Any], spec: Any, outputs: list[Any], fresh: bool) -> None:
        if fresh:
            self._new_storages.update(k for k in map(_storage_of_any, outputs) if k is not None)
        template = [_Made(self._made[v]) if isinstance(v, torch.Tensor) and v in self._made else v for v in flat]
        numbers: list[int | None] = []
        for value in outputs:
            if not isinstance(value, torch.Tensor) or any(value is v for v in flat):
                numbers.append(self._made.get(value) if isinstance(value, torch.Tensor) else None)
                continue
            number = len(self._refs)
            self._refs.append(weakref.ref(value))
            self._made[value] = number
            numbers.append(number)
        self._steps.append((func, template, spec, numbers))

    def _replay_step(
        self, func: Any, template: list[Any], spec: Any, numbers: list[int | None], made: dict[int, torch.Tensor]
    ) -> None:
        flat = [made[v.number] if type(v) is _Made else v for v in template]
        args, kwargs = tree_unflatten(flat, spec)
        out = func(*args, **kwargs)
        for value, number in zip(tree_flatten(out)[0], numbers, strict=False):
            if isinstance(value, torch.distributed.Work):
                value.wait()  # a collective: the captured stream waited for it
            if number is None or not isinstance(value, torch.Tensor):
                continue
            held = self._refs[number]()
            if held is not None and held is not value:
                held.detach().copy_(value.detach())  # the program still holds the captured tensor: written again
                value = held
            made[number] = value

    def _require_capture(self, what: str) -> None:
        if not self._captured:
            raise RuntimeError(f"Called CUDAGraph.{what} without a preceding successful capture.")


_NO_DRIVER = (
    "CUDAGraph.{} returns the CUDA driver's handle, which a simulated GPU does not have: "
    "code that edits or inspects the captured graph through the driver needs a real GPU"
)


def graph_pool_handle() -> tuple[int, int]:
    """`torch.cuda.graph_pool_handle()`: a token of a new memory pool that captures may share."""
    return (next(_pool_ids), 0)


def is_current_stream_capturing() -> bool:
    """`torch.cuda.is_current_stream_capturing()`: whether a capture is under way."""
    return bool(_active)


def refuse_wait_while_capturing() -> None:
    """The host is about to wait for the GPU: refused while a capture is under way, as on the card."""
    if _active:
        _active[0]._refuse_wait()


def patches() -> dict[str, Any]:
    """Names of `torch.cuda` (and `torch.cuda.graphs`) answered here."""
    return {
        "CUDAGraph": CUDAGraph,
        "graph_pool_handle": graph_pool_handle,
        "is_current_stream_capturing": is_current_stream_capturing,
    }


def install() -> None:
    """torch.cuda.graphs' own names, which its `graph` and `make_graphed_callables` call (once per process)."""
    graphs = torch.cuda.graphs
    graphs.CUDAGraph = CUDAGraph  # type: ignore[misc, assignment]
    graphs._graph_pool_handle = lambda: graph_pool_handle()
    graphs._cuda_isCurrentStreamCapturing = is_current_stream_capturing
    nccl_timed.captures.append(_collective)
