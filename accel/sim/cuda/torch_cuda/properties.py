"""What `torch.cuda` reports about a simulated GPU: the card's properties and its memory counters.

`get_device_properties` answers with the figures of the card the rank simulates
(`accel.sim.cuda.gpus.cards`); torch's own `get_device_name`, `get_device_capability` and
`is_bf16_supported` read them, so capability-dependent answers follow the card as torch
computes them. The memory functions read the simulated caching allocator
(`accel.sim.cuda.memory.allocator`): torch's own `memory_allocated`, `max_memory_reserved`,
`memory_summary`, ... run unchanged on top of `memory_stats`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
from typing import Any

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.gpus.cards import MiB
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.memory import history as memory_history
from accel.sim.cuda.memory import report as memory_report_module
from accel.sim.cuda.memory import settings as alloc_config

#: environment knob: "0" turns the memory counters (and out-of-memory) off
MEMORY_ENV = "ACCEL_SIM_GPU_MEMORY"


@dataclasses.dataclass(frozen=True, repr=False)
class CudaDeviceProperties:
    """`torch._C._CudaDeviceProperties` of a simulated GPU: the card's figures, read-only."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: int
    is_multi_gpu_board: int
    max_threads_per_multi_processor: int
    max_threads_per_block: int
    warp_size: int
    regs_per_multiprocessor: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    L2_cache_size: int
    uuid: str
    gcnArchName: str
    pci_bus_id: int
    pci_device_id: int
    pci_domain_id: int

    @classmethod
    def of(cls, model: gpu_models.GpuModel, physical: int) -> CudaDeviceProperties:
        """The properties of host GPU `physical`, a `model` card."""
        # the card's figures under the names they share, then those a card does not have alone
        shared = {f.name: getattr(model, f.name) for f in dataclasses.fields(cls) if hasattr(model, f.name)}
        return cls(
            **shared,
            L2_cache_size=model.l2_cache_size,
            max_threads_per_block=1024,
            uuid=cuda_state.uuid_of(physical).removeprefix("GPU-"),
            gcnArchName=model.name,  # what a CUDA build reports there
            pci_bus_id=0x18 + physical,
            pci_device_id=0,
            pci_domain_id=0,
        )

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // MiB}MB, multi_processor_count={self.multi_processor_count}, "
            f"uuid={self.uuid}, pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
            f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self.L2_cache_size // MiB}MB)"
        )


def _index(device: Any = None) -> int:
    gpus = cuda_state.gpus()
    gpus.use()
    if device is None or (isinstance(device, int) and not isinstance(device, bool) and device < 0):
        return gpus.current
    return gpus.resolve(device).index or 0


def model() -> gpu_models.GpuModel:
    """The card this rank's simulated GPUs are (the memory model's, once CUDA started; else the environment's)."""
    return cuda_memory.card()


def get_device_properties(device: Any = None) -> CudaDeviceProperties:
    """`torch.cuda.get_device_properties`: the card's figures (an index with no GPU fails as on a host)."""
    index = _index(device)
    return CudaDeviceProperties.of(model(), cuda_state.gpus().physical_of(index))


# -- memory ---------------------------------------------------------------------------------------------


def _memory(device: Any) -> cuda_memory.DeviceMemory | None:
    index = _index(device)
    return cuda_memory.device(index) if cuda_memory.is_counting() else None


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """The allocator's statistics (empty before CUDA is used, as torch's are)."""
    if not cuda_state.gpus().initialized:
        return {}
    memory = _memory(device)
    return memory.nested_stats() if memory is not None else {}


def _flat_stats(device: Any = None) -> Any:
    # torch's own flattening of the nested statistics ("allocated_bytes.all.current", ...)
    nested = memory_stats_as_nested_dict(device)
    flat: list[tuple[str, Any]] = []

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                add(f"{prefix}.{key}" if prefix else key, item)
        else:
            flat.append((prefix, value))

    add("", nested)
    flat.sort()
    return collections.OrderedDict(flat)


def reset_peak_memory_stats(device: Any = None) -> None:
    memory = _memory(device)
    if memory is not None:
        memory.reset_peaks()


def reset_accumulated_memory_stats(device: Any = None) -> None:
    memory = _memory(device)
    if memory is not None:
        memory.reset_accumulated()


def empty_cache() -> None:
    """Release the cached segments of every simulated GPU of the rank."""
    if cuda_state.gpus().initialized and cuda_memory.is_counting():
        for index in range(cuda_state.gpus().count):
            cuda_memory.device(index).empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes as `cudaMemGetInfo` gives them: the card less the context and reserved memory."""
    memory = _memory(device)
    card = model()
    if memory is None:
        return card.total_memory - card.context_memory, card.total_memory
    return memory.free_memory(), card.total_memory


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    memory = _memory(device)
    if memory is not None:
        memory.fraction = fraction


def get_per_process_memory_fraction(device: Any = None) -> float:
    memory = _memory(device)
    return memory.fraction if memory is not None else 1.0


def memory_snapshot(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """`torch.cuda.memory_snapshot()`: the segments of every simulated GPU (with the stacks of their blocks
    while `_record_memory_history` keeps them)."""
    return snapshot()["segments"]


#: blocks handed out by `caching_allocator_alloc`, by the address it returned
_raw_blocks: dict[int, tuple[int, Any]] = {}
_raw_addresses = itertools.count(1 << 39, 512)  # while memory is not counted: addresses of no block


def caching_allocator_alloc(size: int, device: Any = None, stream: Any = None) -> int:
    """`torch.cuda.caching_allocator_alloc`: `size` bytes from the simulated allocator, on `stream` (default: the
    device's current one), as an address for `caching_allocator_delete` (out-of-memory as on the card)."""
    index = _index(device)
    if stream is not None and not isinstance(stream, int) and not hasattr(stream, "sim_id"):
        raise TypeError(
            "Invalid type for stream argument, must be `torch.cuda.Stream` or `int` representing a pointer to an "
            "existing stream"
        )
    import torch.cuda

    with torch.cuda.stream(stream if hasattr(stream, "sim_id") else None):
        block = cuda_memory.reserve(index, size)
    address = block.addr if block is not None else next(_raw_addresses)
    _raw_blocks[address] = (index, block)
    return address


def caching_allocator_delete(mem_ptr: int) -> None:
    """`torch.cuda.caching_allocator_delete`: give back what `caching_allocator_alloc` returned at `mem_ptr`."""
    found = _raw_blocks.pop(mem_ptr, None)
    if found is None:
        raise RuntimeError(f"invalid device pointer: {hex(mem_ptr)}")
    cuda_memory.unreserve(*found)


def _allocators() -> list[Any]:
    """The allocators of the process's simulated GPUs, CUDA started (none while memory is not counted)."""
    cuda_state.gpus().start()
    return [cuda_memory.device(i) for i in range(cuda_state.gpus().count)] if cuda_memory.is_counting() else []


def record_memory_history(
    enabled: str | None = "all",
    context: str | None = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    device: Any = None,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: list[str] | None = None,
    record_pinned_host_memory: bool = False,
    record_cuda: bool = True,
) -> None:
    """`torch.cuda.memory._record_memory_history(...)` (as a string `enabled`): the simulated allocators record
    their actions with the Python stacks they happen at (`accel.sim.cuda.memory.history`); on every GPU of the
    process, as torch's (`device` is not read)."""
    if record_cuda:
        memory_history.start(_allocators(), enabled, context, stacks, max_entries, clear_history, skip_actions)


def record_memory_history_legacy(
    enabled: bool,
    record_context: bool = True,
    trace_alloc_max_entries: int = 1,
    trace_alloc_record_context: bool = False,
    device: Any = None,
    record_context_cpp: bool = False,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: list[str] | None = None,
    record_pinned_host_memory: bool = False,
    record_cuda: bool = True,
) -> None:
    """`torch.cuda.memory._record_memory_history(True/False, ...)`, the older form."""
    if record_cuda:
        memory_history.start_legacy(
            _allocators(), enabled, record_context, trace_alloc_max_entries, trace_alloc_record_context,
            clear_history, skip_actions,
        )  # fmt: skip


def snapshot(device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """`torch.cuda.memory._snapshot()` (and so `_dump_snapshot(path)`): segments, blocks and each GPU's trace."""
    found = memory_history.snapshot(_allocators(), alloc_config.snapshot_settings(alloc_config.current()))
    if augment_with_fx_traces:
        found = torch_internals.augment_memory_snapshot(found)
    return found


def history_patches() -> dict[str, Any]:
    """`torch.cuda.memory` name -> its simulated-GPU version: the memory tracker's (private, listed in
    `torch_internals.INTERNALS`)."""
    return {
        "_record_memory_history_impl": record_memory_history,
        "_record_memory_history_legacy": record_memory_history_legacy,
        "_snapshot": snapshot,
        "_set_memory_metadata": memory_history.set_metadata,
        "_get_memory_metadata": memory_history.get_metadata,
    }


def memory_patches() -> dict[str, Any]:
    """`torch.cuda` / `torch.cuda.memory` name -> its simulated-GPU version (see `MEMORY_NAMES`)."""
    return {
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "memory_stats": _flat_stats,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        "set_per_process_memory_fraction": set_per_process_memory_fraction,
        "get_per_process_memory_fraction": get_per_process_memory_fraction,
        "memory_snapshot": memory_snapshot,
        "caching_allocator_alloc": caching_allocator_alloc,
        "caching_allocator_delete": caching_allocator_delete,
    }


#: replaced in `torch.cuda.memory` as well, where torch's own `memory_allocated`, `memory_summary`, ... find them
MEMORY_NAMES = frozenset(memory_patches())


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """A simulated GPU's peak memory since the last peak reset (or, the end-of-run line's, since CUDA started)."""

    device: str  # "cuda:0"
    card: str
    capacity: int  # the card's total memory, bytes
    allocated: int  # peak of `memory_allocated`, bytes
    reserved: int  # peak of `memory_reserved`, bytes

    def __str__(self) -> str:
        size = cuda_memory.format_size
        return (
            f"{self.device} ({self.card}, {size(self.capacity)}): peak allocated {size(self.allocated)}, "
            f"peak reserved {size(self.reserved)} ({100 * self.reserved / self.capacity:.1f}% of the card)"
        )


def _counted(device: Any) -> cuda_memory.DeviceMemory:
    memory = _memory(device)
    if memory is None:
        raise RuntimeError(
            f"simulated GPU memory is not counted in this rank ({MEMORY_ENV}=0); unset it to count memory"
        )
    return memory


def peak_memory(device: Any = None, whole_run: bool = False) -> PeakMemory:
    """The peak memory of simulated GPU `device` (default: the current one) in this rank: since the last
    `reset_peak_memory_stats` as torch's `max_memory_allocated`, or (`whole_run`) since CUDA started."""
    memory = _counted(device)
    return PeakMemory(
        device=f"cuda:{memory.index}",
        card=memory.model.name,
        capacity=memory.model.total_memory,
        allocated=memory.run_peak("allocated") if whole_run else memory.stats[("allocated_bytes", "all")].peak,
        reserved=memory.run_peak("reserved") if whole_run else memory.stats[("reserved_bytes", "all")].peak,
    )


def memory_report(device: Any = None) -> memory_report_module.MemoryReport:
    """What used simulated GPU `device`'s memory in this rank (`accel.sim.memory_report`)."""
    return memory_report_module.report(_counted(device))


def peak_report() -> list[str]:
    """The end of a run: one line per simulated GPU this rank used, its whole run's peak allocated and reserved
    memory against the card (whatever peak resets the script made); then, with the memory report asked,
    what made up each peak (`accel.sim.cuda.memory.report`)."""
    gpus = cuda_state.current()
    if gpus is None or not (gpus.initialized and gpus.started and cuda_memory.is_counting()):
        return []
    peaks = [peak_memory(index, whole_run=True) for index in range(gpus.count)]
    used = [cuda_memory.device(index) for index, peak in enumerate(peaks) if peak.reserved]
    return [str(peak) for peak in peaks if peak.reserved] + memory_report_module.report_lines(used)
