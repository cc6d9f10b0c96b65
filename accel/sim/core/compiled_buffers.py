"""The memory of `torch.compile`'d code as Inductor's kernels take it, on a device that counts memory.

Inductor changes what a compiled region holds on the card in two ways, and both are modelled
here, so that a planned run that compiles its blocks or its loss is counted as the card counts
it:

1. **What backward keeps.** AOTAutograd traces forward and backward together, and Inductor's
   partitioner (`min_cut_rematerialization_partition`) chooses which tensors the forward
   saves: cheap ones (casts, pointwise chains) are recomputed in backward rather than kept.
   This module runs the very same AOTAutograd, with Inductor's decompositions and that
   partitioner, so the saved tensors are the ones Inductor would save.
2. **What is never written.** Inductor fuses pointwise ops and reductions into kernels; an
   intermediate read only inside its kernel is never a buffer. Of the partitioned graphs'
   nodes, a result is counted (`kept_buffers`) when Inductor gives it a buffer: the result of
   an op it calls out to (matmuls, attention, collectives, anything it cannot generate), the
   inputs of such an op, a reduction's result, the result of an op that writes a buffer of
   its own (`cat`, `index_put`, scans), and whatever the graph returns (outputs, saved
   tensors). Pointwise ops, indexing and views, and everything fused into them, are not.

The graphs run op by op on the data under the simulated tensors (the host's), and each kept
result is counted on the simulated GPU until it is freed, through `Runtime.count`. Values are
computed by the same ops as the eager run's after Inductor's decompositions (a decomposed
op may round differently in the last bit, as Inductor's kernels do on the card).

Regions the model does not cover run as Dynamo's graphs eagerly, counted op by op as eager
code is (`covered`): the pieces Dynamo's DDP optimizer splits a DDP model into, DTensor inputs,
collectives, functorch transforms (vmap), tensors moved
to a device the graph names (a factory naming the device, `torch.arange(n, device=x.device)`,
is covered), higher-order ops, and any region AOTAutograd cannot trace over the simulated
tensors (one line on stderr says so).

Activation checkpointing is among them unless ``ACCEL_SIM_COMPILED_CHECKPOINTS=inductor``.
Given torchtitan's per-op selective checkpointing tags, this torch's partitioner saves each
RMSNorm's output and the rotated q and k of a Llama 3 8B block: 80 MiB more per block at
sequence 8192 than eager checkpointing keeps, 2.5 GiB more per GPU over 32 blocks. The
published compiled runs (older torch) held less than eager ones, while later reports on the
card (pytorch/pytorch#161889) found compiled selective checkpointing saving little. Until a
real GPU of this torch shows which (tests/programs/gpu_probe.py records it), such regions
count as eager code by default.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from accel.sim.core import torch_internals
from accel.sim.core.wrapper import tensors_in

#: ops Inductor generates inline (as pointwise loops): fused with their users, no buffer of their own
_INLINED = frozenset(
    {
        "full", "full_like", "scalar_tensor", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like",
        "empty_strided", "iota", "arange", "gather", "scatter", "index", "index_select", "embedding", "where",
        "constant_pad_nd", "slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter", "_to_copy",
        "clone", "masked_fill", "repeat", "flip", "roll", "expand_copy", "permute_copy", "view_copy",
        "squeeze_copy", "unsqueeze_copy", "lift_fresh_copy", "bernoulli", "rand", "rand_like", "randn",
        "randn_like", "randint", "inductor_random", "inductor_seeds", "inductor_lookup_seed",
    }
)  # fmt: skip
#: ops Inductor writes into a buffer of their own, without making their inputs buffers
_OWN_BUFFER = frozenset({"cat", "index_put", "scatter_add", "scatter_reduce", "cumsum", "cumprod", "logcumsumexp"})
#: higher-order ops the model covers (AOTAutograd inlines them)
_COVERED_HOPS = frozenset({"wrap"})
#: set to "inductor": checkpointed compiled regions are modelled too (Inductor's partitioner honouring the
#: checkpoint's tags), instead of counted as eager code; to compare with a real card (see the module's text)
CHECKPOINTS_ENV = "ACCEL_SIM_COMPILED_CHECKPOINTS"


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What the device gives the model: whether it counts now, how a kept result is counted, the host side."""

    counting: Callable[[], bool]
    #: count the storage of an inner (host) tensor on simulated device `index` until it is freed
    count: Callable[[torch.Tensor, int], None]
    #: an op's inner arguments made fit to run together (shapes-only devices: all without data if any is)
    align: Callable[[list, dict], tuple[list, dict]] = lambda args, kwargs: (args, kwargs)
    #: where a tensor made by a factory op in the graph goes on the host, given its bytes
    factory_device: Callable[[int], torch.device] = lambda nbytes: torch.device("cpu")
    #: `draw(op, args, kwargs, index)`: run random op `op` on device `index`'s generator, as its eager ops do
    draw: Callable[[Any, list, dict, int], Any] | None = None
    #: a host tensor shown on simulated device `index` (storage shared): how factories naming it are traced
    adopt: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    #: whether an op runs as the simulated device runs it (its kernels: attention, matmuls with their
    #: workspaces) rather than on the host tensors; `on_device(op, args, kwargs, index)` runs it so
    runs_on_device: Callable[[Any], bool] = lambda op: False
    on_device: Callable[[Any, list, dict, int], Any] | None = None
    #: `fused(index, nbytes)`: one kernel Inductor generates ran on device `index`, reading and writing
    #: `nbytes` at its boundary (a device with a clock times it; ops inside the kernel cost nothing more)
    fused: Callable[[int, int], None] | None = None
    #: `op_by_op(forward)`: how a region the model does not cover runs (its graph op by op); a device with
    #: a clock wraps it so that its ops are timed as Inductor's fused kernels would run on the card
    op_by_op: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda forward: forward


def backend(cls: type, runtime: Runtime) -> Callable[..., Any]:
    """A Dynamo backend for regions of `cls` tensors that Inductor would compile: modelled as above."""

    def inductor_buffers(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        index = _device_index(cls, example_inputs)
        if index is None or not runtime.counting() or torch_internals.compiling_for_ddps_buckets():
            return runtime.op_by_op(gm.forward)  # as Dynamo's "eager" backend: counted as eager code is
        traced = _factories_made_on_device(gm, runtime, index)
        if not covered(traced):
            return runtime.op_by_op(gm.forward)
        try:
            aot = torch_internals.aot_as_inductor(_compiler(runtime, index), drop_moves_within_the_device)
            return aot(traced, example_inputs)
        except Exception as error:  # the region's ops the simulator cannot trace this way (its attention's)
            _counted_as_eager(error)
            return runtime.op_by_op(gm.forward)

    return inductor_buffers


#: why regions were counted op by op after AOTAutograd could not trace them (the first line of each error)
fallbacks: list[str] = []


def _counted_as_eager(error: Exception) -> None:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    if not fallbacks:
        print(
            "accel.sim: a compiled region's memory is counted op by op, as eager code's: it could not be traced "
            f"as Inductor traces it on the simulated device ({type(error).__name__}: {reason[:200]})",
            file=sys.stderr,
            flush=True,
        )
    fallbacks.append(reason)


def _device_index(cls: type, example_inputs: Iterable[Any]) -> int | None:
    """The simulated device of the region's tensors; None when one is not a plain `cls` tensor (a DTensor)."""
    index = None
    for value in example_inputs:
        if not isinstance(value, torch.Tensor):
            continue
        if not isinstance(value, cls):
            return None
        index = value.device.index or 0 if index is None else index
    return index


def covered(gm: fx.GraphModule) -> bool:
    """Whether the model covers Dynamo graph `gm`: no collectives, no functorch transforms (vmap), no
    higher-order op (but `wrap`), and
    no tensor made on (or moved to) a device the graph names: AOTAutograd would make it a plain fake tensor
    of that device, not a simulated one."""
    hops = _covered_hops()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue  # (a method: `x.to(device)` of a simulated tensor is the simulator's own move)
        if any(_names_a_device(value) for value in (*node.args, *node.kwargs.values())):
            return False
        target = node.target
        module = getattr(target, "__module__", "") or ""
        if module.startswith("torch.distributed") or "c10d" in str(target):
            return False
        if "functorch" in module or "functorch" in str(target):  # vmap's levels (flex attention's masks)
            return False
        hop = getattr(target, "namespace", None) == "higher_order"
        if hop and getattr(target, "__name__", "") not in hops:
            return False
    return True


class _MadeOnDevice:
    """A factory op of a Dynamo graph that names a simulated device, made as the device makes it: on the
    host, then shown on the device (`Runtime.adopt`). AOTAutograd then traces it as one of the region's
    tensors, where the factory itself would give a plain fake tensor of that device."""

    def __init__(self, adopt: Callable[[torch.Tensor, int], torch.Tensor], factory: Any, index: int) -> None:
        self.adopt, self.factory, self.index = adopt, factory, index
        self.__name__ = f"{getattr(factory, '__name__', 'factory')}_on_simulated_device"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.adopt(self.factory(*args, **kwargs, device=torch.device("cpu")), self.index)


def _factories_made_on_device(gm: fx.GraphModule, runtime: Runtime, index: int) -> fx.GraphModule:
    """`gm`, or a copy whose factory calls naming the device (`device=` only) are `_MadeOnDevice`'s."""
    if runtime.adopt is None:
        return gm
    found = [
        node
        for node in gm.graph.nodes
        if node.op == "call_function"
        and _names_a_device(node.kwargs.get("device"))
        and not any(_names_a_device(value) for value in node.args)
    ]
    if not found:
        return gm
    graph = copy.deepcopy(gm.graph)
    names = {node.name for node in found}
    for node in graph.nodes:
        if node.op == "call_function" and node.name in names:
            kwargs = dict(node.kwargs)
            named = torch.device(kwargs.pop("device")).index
            node.target = _MadeOnDevice(runtime.adopt, node.target, index if named is None else named)
            node.kwargs = kwargs
    return fx.GraphModule(gm, graph)


def _covered_hops() -> frozenset[str]:
    value = os.environ.get(CHECKPOINTS_ENV, "eager").strip().lower()
    if value not in ("eager", "inductor"):
        raise ValueError(f"{CHECKPOINTS_ENV}={value!r}: use 'eager' (the default) or 'inductor'")
    return _COVERED_HOPS | {"tag_activation_checkpoint"} if value == "inductor" else _COVERED_HOPS


def _names_a_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type != "cpu"
    if isinstance(value, str):
        return value.split(":")[0] in ("cuda", "xla", "meta")
    if isinstance(value, (list, tuple)):
        return any(_names_a_device(item) for item in value)
    return False


def drop_moves_within_the_device(gm: fx.GraphModule) -> None:
    """Take out of a joint graph the copies from the simulated device to itself (`prims.device_put`).

    The graph is traced on the data under the simulated tensors, the host's: there a move between
    the device and itself (`x.to(x.device)` in a decomposition) is a copy, and so is a move between
    a shapes-only device's tensors with and without data (meta and CPU); on the card there is no
    op at all. Left in, the partitioner does not recompute through such a copy and saves a whole
    tensor instead (torchtitan's RMSNorm outputs: 64 MiB per norm of Llama 3 8B at sequence 8192).
    """
    for node in list(gm.graph.nodes):
        put = node.op == "call_function" and node.target is torch.ops.prims.device_put.default
        if put and torch.device(node.args[1]).type in ("cpu", "meta") and isinstance(node.args[0], fx.Node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()


def _compiler(runtime: Runtime, index: int) -> Callable[[fx.GraphModule, list], Callable[..., Any]]:
    def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        kept = kept_buffers(gm.graph)
        kernels = kernel_bytes(gm.graph, kept, runtime.runs_on_device) if runtime.fused is not None else {}

        def run(args: list) -> Any:
            # boxed: the interpreter empties `args`, so that each input (a saved tensor in backward) is freed
            # after its last use, as Inductor's code frees it, not when the whole graph has run
            return _Runner(gm, kept, runtime, index, kernels).boxed_run(args)

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd hands the arguments as a list
        return run

    return compile_graph


def _kind(target: Any) -> str:
    """How Inductor treats an op: view, mutation, fused (pointwise and inlined), reduction, own (a buffer of
    its own, inputs fused), extern (called out to: a buffer for its result and its inputs)."""
    if target is operator.getitem:
        return "view"
    if not torch_internals.is_op(target):
        return "extern"
    if target.is_view:
        return "view"
    schema = torch_internals.op_schema(target)
    if schema.is_mutable:
        return "mutation"
    tags = target.tags
    name = schema.name.split("::")[-1]
    if torch.Tag.pointwise in tags or torch.Tag.nondeterministic_seeded in tags or name in _INLINED:
        return "fused"
    if torch.Tag.reduction in tags:
        return "reduction"
    if name in _OWN_BUFFER:
        return "own"
    return "extern"


def kept_buffers(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of an AOTAutograd graph whose results Inductor writes to buffers (see the module's text)."""
    base: dict[fx.Node, fx.Node] = {}  # a view (or an in-place op's result) -> the node owning its storage

    def owner(node: Any) -> Any:
        return base.get(node, node)

    kept: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            kept.update(owner(arg) for arg in _nodes(node.args))
            continue
        if node.op != "call_function":
            continue
        kind = _kind(node.target)
        first = next(iter(_nodes(node.args)), None)
        if kind in ("view", "mutation") and first is not None:
            base[node] = owner(first)
        elif kind == "extern":
            kept.add(node)
            kept.update(owner(arg) for arg in _nodes((node.args, node.kwargs)))
        elif kind in ("reduction", "own"):
            kept.add(node)
    return {node for node in kept if isinstance(node, fx.Node) and node.op == "call_function"}


def _nbytes(node: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(node.meta.get("val")))


def kernel_bytes(graph: fx.Graph, kept: set[fx.Node], on_device: Callable[[Any], bool]) -> dict[fx.Node, int]:
    """The kernels Inductor generates for a graph: each kept result the host computes (not an op the device
    runs itself), with the bytes its kernel reads and writes: its result, and the buffers (graph inputs,
    kept results) that the ops fused into it read, not the intermediates those ops pass each other."""
    reads: dict[fx.Node, set[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        found: set[fx.Node] = set()
        for arg in _nodes((node.args, node.kwargs)):
            fused_in = arg.op == "call_function" and arg not in kept
            found.update(reads.get(arg, set()) if fused_in else {arg})
        reads[node] = found
    return {
        node: _nbytes(node) + sum(_nbytes(arg) for arg in reads[node])
        for node in kept
        if torch_internals.is_op(node.target) and not on_device(node.target) and _kind(node.target) != "view"
    }


def _nodes(values: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(values, found.append)
    return found


class _Runner(fx.Interpreter):
    """Runs a partitioned graph on the host tensors; counts the results Inductor keeps in buffers."""

    def __init__(
        self, gm: fx.GraphModule, kept: set[fx.Node], runtime: Runtime, index: int, kernels: dict[fx.Node, int]
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.kept, self.runtime, self.index, self.kernels = kept, runtime, index, kernels

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if torch_internals.is_op(target):
            args, kwargs = self.runtime.align(list(args), dict(kwargs))
            if target is torch.ops.prims.device_put.default:
                return args[0].clone()  # between the simulated device and itself: the host holds both
            kwargs = self._placed(args, kwargs)
            if self.runtime.on_device is not None and self.runtime.runs_on_device(target):
                return self.runtime.on_device(target, args, kwargs, self.index)
            if torch.Tag.nondeterministic_seeded in target.tags and self.runtime.draw is not None:
                return self.runtime.draw(target, args, kwargs, self.index)
        return super().call_function(target, tuple(args), kwargs)

    def _placed(self, args: list, kwargs: dict) -> dict:
        # a factory in the graph names the host (the graph was traced on the simulated tensors' data); a
        # tensor without data (shapes only) makes one without data
        node = self.current_node
        if "device" not in kwargs or not isinstance(node.meta.get("val"), torch.Tensor):
            return kwargs
        if any(t.is_meta for t in tensors_in(args)):
            return {**kwargs, "device": torch.device("meta")}
        value = node.meta["val"]
        return {**kwargs, "device": self.runtime.factory_device(value.numel() * value.element_size())}

    def run_node(self, node: fx.Node) -> Any:
        self.current_node = node
        result = super().run_node(node)
        if node in self.kept:
            for value in tensors_in(result):
                self.runtime.count(value, self.index)
            nbytes = self.kernels.get(node)
            if nbytes is not None and self.runtime.fused is not None:
                self.runtime.fused(self.index, nbytes)
        return result
