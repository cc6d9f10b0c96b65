"""The allocator's history on simulated GPUs: `torch.cuda.memory._record_memory_history` and `_snapshot`.

PyTorch's own memory tracker records what the caching allocator does (allocations, frees,
segments taken from and given back to the driver, out-of-memory) with the Python stack of
each, and `torch.cuda.memory._snapshot()` / `_dump_snapshot(path)` hand it out with the
segments and blocks of the moment. People read it with pytorch.org/memory_viz or
`torch.cuda._memory_viz` (and torchtitan, among others, writes one per rank at each
profiled step and at out-of-memory). On a simulated GPU the same calls record the
simulated allocator's actions (`accel.sim.cuda.memory.allocator`) in torch's format, so the same
viewers show where a planned run's memory goes.

What differs from a real card: stacks are Python frames only (a CUDA build's `stacks="all"`
adds C++ frames), and the simulator's own frames are left out, so a stack reads as the
program's. Addresses are the simulated allocator's (each segment starts at a multiple of 1 TiB).
"""

from __future__ import annotations

import collections
import os
import pathlib
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accel.sim.cuda.memory.allocator import Block, DeviceMemory

#: `_record_memory_history`'s `context`: how much keeps a stack (torch's RecordContext: never, the live blocks'
#: ("state"), also the trace's allocations ("alloc"), also its frees ("all"))
_LEVELS = {None: 0, "state": 1, "alloc": 2, "all": 3}
_ACTIONS = frozenset(
    {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap",
     "oom", "snapshot"}
)  # fmt: skip

#: the simulator's own files (accel/sim/), whose frames a stack leaves out
_SIM_DIR = str(pathlib.Path(__file__).resolve().parents[2]) + os.sep
#: torch's frames between a program's call and the simulator's kernels (a real card's stack has no Python there)
_DISPATCH_FILES = ("torch/_ops.py", "torch/utils/_python_dispatch.py", "torch/overrides.py")

Frames = list[dict[str, Any]]


class History:
    """What one simulated GPU's allocator records while history is on (and the stacks of its live blocks after)."""

    def __init__(self, level: int, max_entries: int, skip: frozenset[str], recording: bool = True) -> None:
        self.level = level
        self.recording = recording
        #: the trace, a ring of `max_entries` (the oldest go first)
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(max_entries, 1))
        self.skip = skip
        #: address -> the stack a live block or segment there was allocated at (the snapshot's "frames")
        self.block_frames: dict[int, Frames] = {}
        self.segment_frames: dict[int, Frames] = {}

    def record(self, action: str, addr: int, size: int, stream: int, frames: Frames | None) -> None:
        if not self.recording or action in self.skip:
            return
        entry: dict[str, Any] = {"action": action, "addr": addr, "size": size, "stream": stream}
        entry.update(compile_context="N/A", user_metadata=get_metadata())
        if frames is not None and self.level >= _LEVELS["alloc"]:
            entry["frames"] = frames
        entry["time_us"] = time.time_ns() // 1000
        self.entries.append(entry)

    def allocated(self, block: Block, requested: int) -> None:
        frames = python_frames() if self.recording and self.level else None
        if frames is not None:
            self.block_frames[block.addr] = frames
        self.record("alloc", block.addr, requested, block.stream, frames)

    def freed(self, block: Block) -> None:
        frames = self.block_frames.pop(block.addr, None)
        if not self.recording:
            return
        if self.level >= _LEVELS["all"]:
            frames = python_frames()
        # torch records the request, then its completion once no other stream uses the block: at once here
        # (the simulator finishes each stream's work as it is issued)
        self.record("free_requested", block.addr, block.requested, block.stream, frames)
        self.record("free_completed", block.addr, block.requested, block.stream, frames)

    def segment(self, action: str, addr: int, size: int, stream: int) -> None:
        grows = action in ("segment_alloc", "segment_map")
        frames = self.segment_frames.get(addr)
        if self.recording and self.level and (grows or self.level >= _LEVELS["all"]):
            frames = python_frames()
        if grows and frames is not None:
            self.segment_frames.setdefault(addr, frames)
        elif action == "segment_free":
            self.segment_frames.pop(addr, None)
        self.record(action, addr, size, stream, frames)

    def out_of_memory(self, size: int, device_free: int, stream: int) -> None:
        """A request of `size` bytes (rounded) found no room; CUDA said `device_free` bytes were free."""
        self.record("oom", device_free, size, stream, python_frames() if self.level else None)
        if self.entries and self.entries[-1]["action"] == "oom":
            entry = self.entries[-1]
            entry["device_free"] = entry.pop("addr")


#: `torch.cuda.memory._set_memory_metadata`'s text, per thread (as torch keeps it)
_metadata = threading.local()


def set_metadata(metadata: str) -> None:
    """`_set_memory_metadata(text)`: the trace's entries made by this thread carry `text` ("" clears it)."""
    if not isinstance(metadata, str):
        raise TypeError(f"metadata must be a str, got {type(metadata).__name__}")
    _metadata.text = metadata


def get_metadata() -> str:
    """`_get_memory_metadata()`: the text this thread's entries carry."""
    return getattr(_metadata, "text", "")


def python_frames() -> list[dict[str, Any]]:
    """The Python stack here, innermost first, as torch records it ({"filename", "line", "name"}), without the
    simulator's frames and the dispatch frames it causes under the program's innermost call."""
    frame = sys._getframe(1)
    found: list[dict[str, Any]] = []
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SIM_DIR) and not (not found and name.endswith(_DISPATCH_FILES)):
            found.append({"filename": name, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back  # type: ignore[assignment]
    return found


def start(
    devices: list[DeviceMemory],
    enabled: str | None = "all",
    context: str | None = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    clear_history: bool = False,
    skip_actions: list[str] | None = None,
) -> None:
    """`_record_memory_history(enabled, context, stacks, max_entries, ...)` on every simulated GPU of the process.

    `enabled`: "all" records the allocator's actions, "state" only the last one (torch keeps one entry), None
    stops recording and drops the trace (live blocks keep their stacks for later snapshots).
    """
    _check(enabled, context, stacks, skip_actions)
    skip = frozenset(skip_actions or ())
    for memory in devices:
        with memory.lock:
            earlier = memory.history
            if enabled is None:
                new = History(0, 1, skip, recording=False)
            else:
                new = History(_LEVELS[context], max_entries if enabled == "all" else 1, skip)
                if earlier is not None and not clear_history:
                    new.entries.extend(earlier.entries)
            if earlier is not None:
                new.block_frames, new.segment_frames = earlier.block_frames, earlier.segment_frames
            memory.history = new


def _check(enabled: Any, context: Any, stacks: Any, skip_actions: list[str] | None) -> None:
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
    if context not in _LEVELS:
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
    unknown = sorted(set(skip_actions or ()) - _ACTIONS)
    if unknown:
        raise ValueError(f"unknown action(s) in skip_actions: {unknown}; the actions are {sorted(_ACTIONS)}")


def start_legacy(
    devices: list[DeviceMemory],
    enabled: bool,
    record_context: bool = True,
    trace_alloc_max_entries: int = 1,
    trace_alloc_record_context: bool = False,
    clear_history: bool = False,
    skip_actions: list[str] | None = None,
) -> None:
    """`_record_memory_history(True/False, ...)`, the older form: `trace_alloc_max_entries` entries, stacks of
    live blocks if `record_context`, and of the trace's allocations too if `trace_alloc_record_context`."""
    context = ("alloc" if trace_alloc_record_context else "state") if record_context else None
    start(devices, "all" if enabled else None, context, max_entries=trace_alloc_max_entries,
          clear_history=clear_history, skip_actions=skip_actions)  # fmt: skip


def snapshot(devices: list[DeviceMemory], settings: dict[str, Any]) -> dict[str, Any]:
    """`torch.cuda.memory._snapshot()`: every simulated GPU's segments (their blocks with the stacks they were
    allocated at, if recorded) and each GPU's trace, oldest first, in torch's format.

    As torch's, taking it adds a "snapshot" action to the trace (seen in the next snapshot)."""
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for memory in devices:
        with memory.lock:
            history = memory.history
            traces.append([dict(entry) for entry in history.entries] if history is not None else [])
            found = memory.segment_snapshot()
            if history is not None:
                for segment in found:
                    segment["frames"] = list(history.segment_frames.get(segment["address"], []))
                    for block in segment["blocks"]:
                        if block["state"] == "active_allocated":
                            block["frames"] = list(history.block_frames.get(block["address"], []))
                active = sum(segment["active_size"] for segment in found)
                history.record("snapshot", 0, active, 0, None)
            segments.extend(found)
    return {"segments": segments, "device_traces": traces, "allocator_settings": settings, "external_annotations": []}
