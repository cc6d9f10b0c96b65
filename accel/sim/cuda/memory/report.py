"""What uses a simulated GPU's memory: the whole run's peak, what made it up, and the memory over a step.

Asked with ``ACCEL_SIM_MEMORY_REPORT`` (``1``, or the path of a picture: ``.html`` or ``.svg``), which
``accel launch --simulate cuda --memory_report PATH``, ``accel.sim.launch(..., report_memory=...)``
and ``@distributed_test(report_memory=True)`` set. From the moment CUDA starts in the rank, each
storage of a simulated GPU gets a category and a module, as torch's own
`torch.distributed._tools.mem_tracker.MemTracker` decides them:

* by what runs when it is made: in `optimizer.step()`, **optimizer state**; in a collective
  (the simulated NCCL group, functional collectives, FSDP's all-gather and reduce-scatter, DDP's
  buckets), **collective buffers**; in a module's forward (also recomputed in backward),
  **activations** of the innermost module running; in backward, **temporaries** (gradients of
  activations); else **other**;
* then by what it turns out to be: the parameters and buffers of a module, seen as it runs
  (**parameters**, **buffers**), a parameter's gradient once accumulated (**gradients**), the
  optimizer's state tensors after its step (**optimizer state**); these keep their module.

Memory the allocator holds for no storage (cuBLAS workspaces) is **other**. Whenever the
allocated memory reaches a new high, the categories and modules are noted, so the report gives the
breakdown at the whole run's peak whatever `reset_peak_memory_stats()` the script called, and the
breakdown at the last out-of-memory. The memory over the optimizer step that holds the peak (the
whole run without an optimizer) is drawn by category (`picture`).

`accel.sim.memory_report()` returns a rank's `MemoryReport`; the end-of-run lines are `report_lines()`.
Nothing here runs unless asked: a run without the report pays one test per storage made and freed.
"""

from __future__ import annotations

import array
import dataclasses
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from accel.sim.core import torch_internals, wrapper
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.memory import picture as memory_picture
from accel.sim.cuda.memory.allocator import format_size

if TYPE_CHECKING:
    from accel.sim.cuda.memory.allocator import DeviceMemory

#: the environment variable that asks for the report (``1``, or a picture's path); `wanted`, `check_path`
REPORT_ENV = memory_picture.REPORT_ENV
wanted = memory_picture.wanted
check_path = memory_picture.check_path

CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer state",
    "activations",
    "temporaries",
    "collective buffers",
    "other",
)
PARAM, BUFFER, GRAD, OPT, ACT, TEMP, COLLECTIVE, OTHER = range(len(CATEGORIES))
#: the module named for what no module made
NO_MODULE = "(no module)"
BACKWARD = "(backward)"
#: timeline events kept before the oldest are folded into the starting point (3 numbers each)
MAX_EVENTS = 1 << 20


# -- what runs now: the context a storage is made in ------------------------------------------------------


class _Context:
    """What the process is running: modules in forward (innermost last), an optimizer step, their hooks."""

    def __init__(self) -> None:
        self.modules: list[tuple[torch.nn.Module, str]] = []
        self.optimizing = 0
        self.names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self.hooked = WeakIdKeyDictionary()  # parameters with a gradient hook (tensors compare by identity here)
        self.seen = WeakIdKeyDictionary()  # parameters and buffers already categorised
        self.handles: list[Any] = []
        self.collective_files = frozenset(_collective_files())

    def name(self, module: torch.nn.Module) -> str:
        """The module's dotted name under the outermost module that ran (its class name)."""
        name = self.names.get(module)
        if name is None:
            root = type(module).__name__
            for path, sub in module.named_modules():
                kept = [part for part in path.split(".") if part and part not in _WRAPPERS]
                self.names[sub] = ".".join([root, *kept])
            name = self.names[module]
        return name

    def category(self) -> tuple[int, str]:
        """The category and module of a storage made now."""
        module = self.modules[-1][1] if self.modules else None
        if self.optimizing:
            return OPT, module or "(optimizer)"
        if self._in_collective():
            return COLLECTIVE, module or NO_MODULE
        if module is not None:
            return ACT, module
        if torch_internals.in_backward():
            return TEMP, BACKWARD
        return OTHER, NO_MODULE

    def _in_collective(self) -> bool:
        frame: Any = sys._getframe(1)
        files = self.collective_files
        for _ in range(48):
            if frame is None:
                return False
            code = frame.f_code
            if code.co_filename in files or code.co_name in _DDP_BUCKETS:
                return True
            frame = frame.f_back
        return False


#: parts of module names that are wrappers, not the model's own (DDP, torch.compile, checkpointing, FSDP1)
_WRAPPERS = frozenset(("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"))
#: DDP's functions that make (and rebuild) its gradient buckets
_DDP_BUCKETS = frozenset(("_ddp_init_helper", "_rebuild_buckets"))


#: the simulator's own modules whose code makes collective buffers (the simulated NCCL group, functional
#: collectives): each names itself here (`collective_source`), as the rooms above the memory one do
_COLLECTIVE_SOURCES: list[str] = []


def collective_source(path: str) -> None:
    """Count the buffers that the code of file `path` allocates as collective buffers."""
    if path not in _COLLECTIVE_SOURCES:
        _COLLECTIVE_SOURCES.append(path)


def _collective_files() -> list[str]:
    """The source files whose code makes collective buffers: the simulator's (`collective_source`),
    torch.distributed's collectives and FSDP2's."""
    import torch.distributed as dist

    here = os.path.dirname(dist.__file__)
    return [
        *_COLLECTIVE_SOURCES,
        os.path.join(here, "_functional_collectives.py"),
        os.path.join(here, "distributed_c10d.py"),
        os.path.join(here, "fsdp", "_fully_shard", "_fsdp_collectives.py"),
    ]


_context: list[_Context] = []


def _start_hooks(context: _Context) -> None:
    """Follow modules and optimizers: torch's global hooks, public ones (removed by `_stop_hooks`)."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    context.handles = [
        nn_module.register_module_forward_pre_hook(_before_forward),
        nn_module.register_module_forward_hook(_after_forward, always_call=True),
        optim_module.register_optimizer_step_pre_hook(_before_step),
        optim_module.register_optimizer_step_post_hook(_after_step),
    ]


def stop() -> None:
    """Follow nothing any more (memory is not counted, or CUDA starts again)."""
    _stop_hooks()


def _stop_hooks() -> None:
    for context in _context:
        for handle in context.handles:
            handle.remove()
    _context.clear()


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    context = _context[0]
    name = context.name(module)
    context.modules.append((module, name))
    seen = context.seen
    for parameter in module.parameters(recurse=False):
        # once per parameter on a simulated GPU (FSDP2 resizes its unsharded ones: followed as resizes;
        # one given new data is categorised again at the optimizer's next step)
        if parameter not in seen and _classify(parameter, PARAM, name):
            seen[parameter] = True
            if parameter.grad is not None:
                _classify(parameter.grad, GRAD, name)
            _hook_gradient(context, parameter)
    for buffer in module.buffers(recurse=False):
        if buffer not in seen and _classify(buffer, BUFFER, name):
            seen[buffer] = True


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    stack = _context[0].modules if _context else []
    while stack:  # the module's own entry, and any an exception left above it
        if stack.pop()[0] is module:
            break


def _hook_gradient(context: _Context, parameter: torch.Tensor) -> None:
    """Once per parameter: its gradient is a gradient as soon as it is accumulated (not a temporary)."""
    if parameter in context.hooked or not (parameter.requires_grad and parameter.is_leaf):
        return
    context.hooked[parameter] = True
    parameter.register_post_accumulate_grad_hook(_accumulated)


def _accumulated(parameter: torch.Tensor) -> None:
    if _context and parameter.grad is not None:
        _classify(parameter.grad, GRAD, _module_of(parameter))


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _context:
        return
    _context[0].optimizing += 1
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            module = _module_of(parameter)
            _classify(parameter, PARAM, module)
            if parameter.grad is not None:
                _classify(parameter.grad, GRAD, module)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _context:
        return
    for parameter, state in optimizer.state.items():
        module = _module_of(parameter) if isinstance(parameter, torch.Tensor) else NO_MODULE
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor):
                _classify(value, OPT, module)
    _context[0].optimizing -= 1
    for memory in cuda_memory.counting_list():
        if memory.tracking is not None:
            memory.tracking.step_ended()


def _on_simulated_gpu(tensor: Any) -> bool:
    """Whether `tensor` is a simulated GPU's (the core's wrapper tensor on "cuda"; the rooms above say which)."""
    return isinstance(tensor, wrapper.WrapperTensor) and tensor.device.type == "cuda"


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The key the allocator counts `tensor`'s storage under (a DTensor's: its local shard's); None if none."""
    if not _on_simulated_gpu(tensor):
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is None or not isinstance(tensor, dtensor.DTensor):
            return None
        with torch.no_grad():
            tensor = tensor.to_local()
        if not _on_simulated_gpu(tensor):
            return None
    inner = wrapper.unwrap(tensor)
    try:
        return inner.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a fake or meta tensor (Dynamo tracing) has none
        return None


def _owner(tensor: torch.Tensor) -> tuple[Tracking, int] | None:
    """The bookkeeping that counts `tensor`'s storage, and its key (None: not counted, or not asked)."""
    key = _storage_key(tensor)
    memory = cuda_memory.holder(key) if key is not None else None
    if memory is None or memory.tracking is None:
        return None
    return memory.tracking, key  # type: ignore[return-value]  # key is an int here


def _classify(tensor: torch.Tensor, category: int, module: str) -> bool:
    """Categorise `tensor`'s storage; whether it is counted (on a simulated GPU followed by the report)."""
    owner = _owner(tensor)
    if owner is not None:
        owner[0].classify(owner[1], category, module)
    return owner is not None


def _module_of(parameter: torch.Tensor) -> str:
    """The module a parameter was seen in (its gradient and optimizer state are that module's too)."""
    owner = _owner(parameter)
    found = owner[0].owners.get(owner[1]) if owner is not None else None
    return found[1] if found is not None else NO_MODULE


# -- one GPU's bookkeeping ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Moment:
    """The memory of a GPU at one moment: allocated, reserved, bytes by category and by (module, category)."""

    allocated: int
    reserved: int
    sums: list[int]
    modules: dict[tuple[str, int], int]
    #: at an out-of-memory: the bytes the failed request asked
    request: int = 0

    def by_category(self) -> dict[str, int]:
        """Bytes by category name; "other" also holds what the allocator holds for no storage (workspaces)."""
        found = dict(zip(CATEGORIES, self.sums, strict=True))
        found["other"] += self.allocated - sum(self.sums)
        return found

    def top_modules(self, count: int = 5) -> list[tuple[str, int]]:
        """The modules holding the most memory (their activations, parameters, gradients, optimizer state)."""
        totals: dict[str, int] = {}
        for (module, _), nbytes in self.modules.items():
            if not module.startswith("("):
                totals[module] = totals.get(module, 0) + nbytes
        ranked = sorted(totals.items(), key=lambda item: -item[1])
        return [item for item in ranked if item[1] > 0][:count]


def _events() -> tuple[array.array, array.array, array.array, array.array]:
    """A timeline: category, change in bytes, allocated and reserved after it, per event."""
    return array.array("b"), array.array("q"), array.array("q"), array.array("q")


class Tracking:
    """The memory report's bookkeeping of one simulated GPU: each counted storage's category and module."""

    def __init__(self, gpu: DeviceMemory) -> None:
        self.gpu = gpu
        self._allocated, self._reserved = gpu.stats[("allocated_bytes", "all")], gpu.stats[("reserved_bytes", "all")]
        self.owners: dict[int, list[Any]] = {}  # key -> [category, module, bytes]
        self.sums = [0] * len(CATEGORIES)
        self.modules: dict[tuple[str, int], int] = {}
        self.peak = -1
        self.at_peak: Moment | None = None
        self.at_oom: Moment | None = None
        #: the timeline of the step under way (from `start`), and that of the step that held the peak
        self.start, self.events = list(self.sums), _events()
        self.peak_event, self.peak_in_events = 0, False
        self.saved: tuple[list[int], tuple[array.array, ...], int] | None = None

    def moment(self, request: int = 0) -> Moment:
        """The GPU's memory now (at an out-of-memory: with the `request` that failed)."""
        return Moment(self.gpu.allocated, self.gpu.reserved, list(self.sums), dict(self.modules), request)

    def added(self, key: int) -> None:
        """Storage `key` was made: its category and module are what runs now."""
        block = self.gpu.blocks.get(key)
        if block is None:
            return
        if key in self.owners:
            self.removed(key)
        category, module = _context[0].category() if _context else (OTHER, NO_MODULE)
        self.owners[key] = [category, module, block.size]
        self._move(category, module, block.size)
        if self.gpu.allocated > self.peak:
            self._note_peak()

    def removed(self, key: int) -> None:
        """Storage `key` was freed."""
        owner = self.owners.pop(key, None)
        if owner is not None:
            self._move(owner[0], owner[1], -owner[2])

    def resized(self, key: int) -> None:
        """Storage `key` changed size (FSDP2 frees and refills its unsharded parameters this way)."""
        owner = self.owners.get(key)
        block = self.gpu.blocks.get(key)
        if owner is None:
            if block is not None:
                self.added(key)
            return
        size = block.size if block is not None else 0
        self._move(owner[0], owner[1], size - owner[2])
        owner[2] = size
        if self.gpu.allocated > self.peak:
            self._note_peak()

    def classify(self, key: int, category: int, module: str) -> None:
        """Storage `key` turned out to be of `category` (a parameter, a gradient, optimizer state), of `module`."""
        owner = self.owners.get(key)
        if owner is None or (owner[0] == category and owner[1] == module):
            return
        self._move(owner[0], owner[1], -owner[2])
        owner[0], owner[1] = category, module
        self._move(category, module, owner[2])

    def _move(self, category: int, module: str, nbytes: int) -> None:
        self.sums[category] += nbytes
        where = (module, category)
        modules = self.modules
        modules[where] = modules.get(where, 0) + nbytes
        kinds, changes, allocated, reserved = self.events
        kinds.append(category)
        changes.append(nbytes)
        allocated.append(self._allocated.current)
        reserved.append(self._reserved.current)
        if len(kinds) >= MAX_EVENTS:
            self.step_ended()

    def _note_peak(self) -> None:
        self.peak = self.gpu.allocated
        self.at_peak = self.moment()
        self.peak_event, self.peak_in_events = len(self.events[0]), True

    def out_of_memory(self, nbytes: int) -> None:
        """A request of `nbytes` did not fit: keep the breakdown of this moment."""
        self.at_oom = self.moment(nbytes)

    def step_ended(self) -> None:
        """An optimizer step ended (or the timeline is full): keep its timeline if it held the peak."""
        if self.peak_in_events:
            self.saved = (self.start, self.events, self.peak_event)
            self.peak_in_events = False
        self.start, self.events = list(self.sums), _events()

    def timeline(self) -> tuple[list[int], tuple[array.array, ...], int]:
        """The starting sums, events and the index of the peak event of the step that held the peak."""
        if self.peak_in_events or self.saved is None:
            return self.start, self.events, self.peak_event
        return self.saved


# -- starting, and the report -----------------------------------------------------------------------------


def configure(devices: list[DeviceMemory]) -> None:
    """CUDA starts in the rank (each test, each script): follow its GPUs if the report is asked, else nothing."""
    _stop_hooks()
    if wanted() is None:
        return
    context = _Context()
    _context.append(context)
    _start_hooks(context)
    for memory in devices:
        memory.tracking = Tracking(memory)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What used a simulated GPU's memory in this rank (`accel.sim.memory_report()`); bytes throughout.

    `peak_allocated` / `peak_reserved`: the whole run's peaks (since CUDA started in the rank),
    whatever `reset_peak_memory_stats()` the script called. With the report asked
    (``ACCEL_SIM_MEMORY_REPORT``): `at_peak` and `now`, bytes by category (`CATEGORIES`, the
    allocator's rounded sizes; they add up to the allocated memory), `top_modules` at the peak
    (dotted name, bytes), and `at_out_of_memory` with the request that failed (last one); else empty.
    """

    device: str
    card: str
    capacity: int
    peak_allocated: int
    peak_reserved: int
    at_peak: dict[str, int]
    top_modules: list[tuple[str, int]]
    now: dict[str, int]
    at_out_of_memory: dict[str, int]
    out_of_memory_request: int = 0

    def lines(self) -> list[str]:
        """The breakdown as the end of a run prints it (nothing when the report was not asked)."""
        found = []
        if self.at_peak:
            found.append(f"{self.device} at the peak ({_size(self.peak_allocated)}): {_listed(self.at_peak)}")
        if self.top_modules:
            modules = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in self.top_modules)
            found.append(f"{self.device} top modules at the peak: {modules}")
        if self.at_out_of_memory:
            found.append(
                f"{self.device} at the out-of-memory (tried to allocate {_size(self.out_of_memory_request)}): "
                f"{_listed(self.at_out_of_memory)}"
            )
        return found


def _size(nbytes: int) -> str:

    return format_size(nbytes)


def _listed(categories: dict[str, int]) -> str:
    return ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in categories.items() if nbytes) or "nothing"


def report(memory: DeviceMemory) -> MemoryReport:
    """The report of one simulated GPU."""
    tracking = memory.tracking
    at_peak = tracking.at_peak if tracking is not None else None
    at_oom = tracking.at_oom if tracking is not None else None
    return MemoryReport(
        device=f"cuda:{memory.index}",
        card=memory.model.name,
        capacity=memory.model.total_memory,
        peak_allocated=memory.run_peak("allocated"),
        peak_reserved=memory.run_peak("reserved"),
        at_peak=at_peak.by_category() if at_peak is not None else {},
        top_modules=at_peak.top_modules() if at_peak is not None else [],
        now=tracking.moment().by_category() if tracking is not None else {},
        at_out_of_memory=at_oom.by_category() if at_oom is not None else {},
        out_of_memory_request=at_oom.request if at_oom is not None else 0,
    )


def report_lines(devices: list[DeviceMemory]) -> list[str]:
    """The end of a run: each followed GPU's breakdown at the peak, and the picture written if asked."""
    lines = [line for memory in devices if memory.tracking is not None for line in report(memory).lines()]
    path = wanted()
    followed = [memory for memory in devices if memory.tracking is not None and memory.tracking.at_peak]
    if path and followed:
        path = picture_path(path)
        memory_picture.write(path, [_drawn(memory) for memory in followed])
        lines.append(f"memory over the step of the peak, by category: {path}")
    return lines


def picture_path(path: str) -> str:
    """`path` for this rank: "{rank}" in it is the rank; else, with several ranks, ".rankN" before the suffix."""
    rank = os.environ.get("RANK", "0")
    if "{rank}" in path:
        return path.replace("{rank}", rank)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        root, suffix = os.path.splitext(path)
        return f"{root}.rank{rank}{suffix}"
    return path


def _drawn(memory: DeviceMemory) -> memory_picture.Series:
    """The timeline of the step that held the peak, as bytes by category after each event."""
    assert memory.tracking is not None
    start, (kinds, changes, allocated, reserved), peak = memory.tracking.timeline()
    return memory_picture.Series(
        title=f"rank {os.environ.get('RANK', '0')}, {report(memory).device} ({memory.model.name})",
        categories=CATEGORIES,
        start=start,
        kinds=kinds,
        changes=changes,
        allocated=allocated,
        reserved=reserved,
        peak_index=peak,
        capacity=memory.model.total_memory,
    )


cuda_memory.follow_starts(configure, stop)  # CUDA starting in the rank starts the report (when it is asked)
