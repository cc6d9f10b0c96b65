"""GPU memory of a simulated GPU, counted as PyTorch's CUDA caching allocator counts it.

Every storage a simulated CUDA tensor holds is a block of this model, which follows the
rules of c10/cuda/CUDACachingAllocator.cpp. By default (the rules the allocator's settings,
``PYTORCH_CUDA_ALLOC_CONF``, change are in `accel.sim.cuda.memory.configured`, the settings in
`accel.sim.cuda.memory.settings`): a request is rounded up to 512 bytes; requests up to 1 MiB come from
2 MiB segments (the small pool), larger ones from 20 MiB segments below 10 MiB, and
from segments of their own size rounded up to 2 MiB above; the smallest free block that
fits is taken (lowest address first) and split when what is left is worth keeping (at
least 512 bytes in the small pool, more than 1 MiB in the large one); freed blocks merge
with free neighbours, and segments stay reserved until `empty_cache()`. A segment that
does not fit in what the card has left frees the cached segments and tries again, then
raises `torch.OutOfMemoryError` with CUDA's message, before the host allocates anything
for it where the size is known in advance (factories, copies to the GPU, storage
resizes), and just after the host kernel ran otherwise (its result is dropped at once).

What a GPU spends outside these counters is outside them here too, and taken off the card's
free memory (`mem_get_info`, out-of-memory): the CUDA context, the kernels loaded at the first
launch, cuBLAS's own memory and each NCCL communicator's, in the amounts a real H200 showed. cuBLAS workspaces come
from the allocator on a GPU, and here (`accel.sim.cuda.kernels.blas`).

The processes of a simulated node share its GPUs (`accel.sim.cuda.memory.node`): what the others use on
a GPU is taken off its free memory too, and out-of-memory names them as CUDA does.

Each allocator keeps its peaks from before the script's `reset_peak_memory_stats()` calls (the
end of a run reports the whole run's, `run_peak`), and, when the memory report is asked, tells
its `tracking` (`accel.sim.cuda.memory.report`) of every storage made, resized and freed.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.gpus.cards import GpuModel
from accel.sim.cuda.memory import configured
from accel.sim.cuda.memory import history as memory_history
from accel.sim.cuda.memory import node as node_memory
from accel.sim.cuda.memory import settings as alloc_config
from accel.sim.cuda.memory.blocks import Block, Pool
from accel.sim.cuda.memory.settings import (  # CUDACachingAllocator.cpp's sizes, defined once
    K_LARGE_BUFFER,
    K_MIN_BLOCK,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
)

_POOLS = ("small_pool", "large_pool")
_STATS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "requested_bytes",
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "inactive_split_bytes",
)


splits_pools = ("all", *_POOLS)


def round_size(size: int) -> int:
    """A request as the allocator rounds it: at least 512 bytes, a multiple of 512."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The size of the segment the allocator asks the driver for, to serve a (rounded) request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def format_size(size: int) -> str:
    """Bytes as CUDA's out-of-memory message writes them ("20.00 MiB")."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


class _Stat:
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, amount: int) -> None:
        self.current += amount
        if amount > 0:
            self.allocated += amount
            if self.current > self.peak:
                self.peak = self.current
        else:
            self.freed -= amount

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class DeviceMemory:
    """The caching allocator of one simulated GPU."""

    #: this GPU in the ledger of the node's processes (`accel.sim.cuda.memory.node`); None: counted alone
    node: node_memory.Seat | None = None
    #: what `torch.cuda.memory._record_memory_history` asked to record (`accel.sim.cuda.memory.history`)
    history: memory_history.History | None = None

    def __init__(self, index: int, model: GpuModel, settings: alloc_config.AllocatorSettings | None = None) -> None:
        self.index = index
        self.model = model
        self._settle(settings or alloc_config.current())
        #: the cached blocks by size class and stream (a stream reuses only the blocks allocated on it)
        self.pools: dict[tuple[bool, int], Pool] = {}
        self._pool_counters = {True: [0], False: [0]}
        self.segments: list[Block] = []  # first block of each segment
        self._addresses = itertools.count(1 << 40, 1 << 40)  # one address range per segment
        self.stats = {(name, pool): _Stat() for name in _STATS for pool in ("all", *_POOLS)}
        self.counters = {"num_alloc_retries": 0, "num_ooms": 0, "num_device_alloc": 0, "num_device_free": 0}
        self._hot = {
            small: tuple(
                self.stats[(name, pool)]
                for name in ("allocated_bytes", "requested_bytes", "allocation")
                for pool in ("all", _POOLS[0] if small else _POOLS[1])
            )
            for small in (True, False)
        }
        self.lock = threading.RLock()
        #: the block of each counted storage, by key
        self.blocks: dict[int, Block] = {}
        #: memory the process holds on the card outside PyTorch's counters, by what holds it
        self.outside: dict[object, int] = {"context": model.context_memory}
        self.outside_bytes = model.context_memory

    def _settle(self, settings: alloc_config.AllocatorSettings) -> None:
        """What a new allocator takes from the settings, and what it counts beyond the default rules."""
        self.expandables: list[configured.Expandable] = []
        self.configure(settings)
        self.fraction = settings.per_process_memory_fraction
        #: `memory_stats()["max_split_size"]`, fixed when the allocator is made (as torch's)
        self.max_split_stat = settings.max_split_stat
        self.oversize = {"oversize_allocations": _Stat(), "oversize_segments": _Stat()}
        #: the peaks before the last `reset_peak_memory_stats` (the whole run's peak is the larger)
        self.earlier_peaks = {"allocated": 0, "reserved": 0}
        #: the memory report's bookkeeping of this GPU (`accel.sim.cuda.memory.report`); None: not asked
        self.tracking: Any = None

    def configure(self, settings: alloc_config.AllocatorSettings) -> None:
        """Follow `settings` from now on (also those changed at run time: torch reads them at each request)."""
        self.conf = settings
        #: whether requests follow the default rules (`malloc`'s fast path), else `configured`'s (which
        #: also passes over the blocks of expandable segments made before they were turned off)
        self.plain = settings.plain and not self.expandables
        self.mss = settings.max_split_size

    def pool(self, small: bool, stream: int) -> Pool:
        """The pool of cached blocks of size class `small` allocated on `stream`."""
        found = self.pools.get((small, stream))
        if found is None:
            found = self.pools[(small, stream)] = Pool(counter=self._pool_counters[small])
        return found

    def current_stream(self) -> int:
        """The id of this GPU's current stream (`torch.cuda.current_stream`), 0 for the default stream."""
        gpus = cuda_state.current()
        stream = gpus.streams.get(self.index) if gpus is not None else None
        return 0 if stream is None else stream.sim_id

    def note_outside(self, key: object, nbytes: int) -> None:
        """Memory outside PyTorch's counters taken (once per `key`): kernels loaded, a library's, NCCL's."""
        if key not in self.outside:
            self.outside[key] = nbytes
            self.outside_bytes += nbytes
            node_memory.publish(self.node, self.reserved + self.outside_bytes)

    # -- counters --------------------------------------------------------------------------------

    def _count(self, name: str, small: bool, amount: int) -> None:
        self.stats[(name, "all")].add(amount)
        self.stats[(name, _POOLS[0] if small else _POOLS[1])].add(amount)

    @property
    def allocated(self) -> int:
        return self.stats[("allocated_bytes", "all")].current

    @property
    def reserved(self) -> int:
        return self.stats[("reserved_bytes", "all")].current

    def free_memory(self) -> int:
        """What `cudaMemGetInfo` says is free: the card less what is outside PyTorch, the reserved segments
        and what the node's other processes use on it."""
        used = self.outside_bytes + self.reserved + node_memory.others(self.node)
        return max(self.model.total_memory - used, 0)

    # -- allocation -------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> Block | None:
        """A block for a request of `nbytes` (None for 0 bytes, as CUDA gives a null pointer)."""
        if nbytes == 0:
            return None
        with self.lock:
            if not self.plain:
                return configured.malloc(self, nbytes)
            size = round_size(nbytes)
            small = size <= K_SMALL_SIZE
            stream = self.current_stream()
            pool = self.pool(small, stream)
            block = pool.take(size)
            if block is None:
                block = self._new_segment(size, small)
                block.stream = stream
            remaining = block.size - size
            if remaining >= K_MIN_BLOCK if small else remaining > K_SMALL_SIZE:
                pool.put(self.split(block, size))
            block.allocated = True
            block.requested = nbytes
            self._book(small, block.size, nbytes, 1)
            return block

    @staticmethod
    def split(block: Block, size: int) -> Block:
        """Cut `block` after its first `size` bytes; the rest, a block of the same segment that follows it."""
        rest = Block(block.size - size, block.addr + size, block.small)
        rest.segment, rest.mapped, rest.stream = block.segment, block.mapped, block.stream
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        return rest

    def _book(self, small: bool, size: int, nbytes: int, count: int) -> None:
        # The counters every allocation and free changes (this runs for every new storage of
        # a simulated GPU, so unrolled): bytes and number of the blocks, bytes requested; in
        # all pools and in the block's own. (With one stream, "active" equals "allocated".)
        a0, a1, r0, r1, n0, n1 = self._hot[small]
        if count > 0:
            v = a0.current + size
            a0.current = v
            a0.allocated += size
            if v > a0.peak:
                a0.peak = v
            v = a1.current + size
            a1.current = v
            a1.allocated += size
            if v > a1.peak:
                a1.peak = v
            v = r0.current + nbytes
            r0.current = v
            r0.allocated += nbytes
            if v > r0.peak:
                r0.peak = v
            v = r1.current + nbytes
            r1.current = v
            r1.allocated += nbytes
            if v > r1.peak:
                r1.peak = v
            v = n0.current + 1
            n0.current = v
            n0.allocated += 1
            if v > n0.peak:
                n0.peak = v
            v = n1.current + 1
            n1.current = v
            n1.allocated += 1
            if v > n1.peak:
                n1.peak = v
        else:
            a0.current -= size
            a0.freed += size
            a1.current -= size
            a1.freed += size
            r0.current -= nbytes
            r0.freed += nbytes
            r1.current -= nbytes
            r1.freed += nbytes
            n0.current -= 1
            n0.freed += 1
            n1.current -= 1
            n1.freed += 1

    def _new_segment(self, size: int, small: bool) -> Block:
        alloc = allocation_size(size)
        if not self._fits(alloc):
            self.counters["num_alloc_retries"] += 1
            self.empty_cache()
            if not self._fits(alloc):
                raise self.out_of_memory(size, alloc)
        return self.new_segment_block(alloc, small)

    def out_of_memory(self, size: int, alloc: int) -> torch.OutOfMemoryError:
        """The error for a request of `size` bytes (rounded) whose segment of `alloc` bytes the card cannot hold."""
        self.counters["num_ooms"] += 1
        if self.history is not None:
            self.history.out_of_memory(size, self.free_memory(), self.current_stream())
        return torch.OutOfMemoryError(self.oom_message(alloc))

    def new_segment_block(self, alloc: int, small: bool) -> Block:
        """A segment of `alloc` bytes the driver gave (`cudaMalloc`), as one free block, counted."""
        block = Block(alloc, next(self._addresses), small)
        block.segment_size = alloc
        self.segments.append(block)
        self.counters["num_device_alloc"] += 1
        self._count("reserved_bytes", small, alloc)
        self._count("segment", small, 1)
        if alloc >= self.mss:
            self.oversize["oversize_segments"].add(1)
        if "kernels" not in self.outside:  # the first allocation: its kernels are the first launched
            self.note_outside("kernels", self.model.kernels_memory)
        if self.history is not None:
            self.history.segment("segment_alloc", block.addr, alloc, self.current_stream())
        return block

    def unreserve_segment(self, head: Block) -> None:
        """Count segment `head` (out of its pool) as given back to the driver (`cudaFree`)."""
        self._count("reserved_bytes", head.small, -head.segment_size)
        self._count("segment", head.small, -1)
        self.counters["num_device_free"] += 1
        if head.segment_size >= self.mss:
            self.oversize["oversize_segments"].add(-1)
        if self.history is not None:
            self.history.segment("segment_free", head.addr, head.segment_size, head.stream)

    def _fits(self, alloc: int) -> bool:
        """Whether `alloc` more bytes fit on the card; if so they are this process's on the node at once.

        Checked and taken in one step, as the driver allocates: two processes of a node cannot
        both take the last free memory of a GPU.
        """
        with node_memory.deciding(self.node):
            if self.reserved + alloc > self.limit():
                return False
            node_memory.publish(self.node, self.reserved + self.outside_bytes + alloc)
            return True

    def free(self, block: Block) -> None:
        """Give `block` back: it merges with free neighbours and stays cached in its pool."""
        with self.lock:
            if self.history is not None:
                self.history.freed(block)
            small = block.small
            block.allocated = False
            self._book(small, block.size, block.requested, -1)
            if block.size >= self.mss:
                self.oversize["oversize_allocations"].add(-1)
            pool = self.pool(small, block.stream)  # (a segment's blocks are all of one stream)
            before = block.prev
            if before is not None and not before.allocated and before.mapped:
                # the free block before takes this one in (a segment's first block stays its first)
                pool.remove(before)
                before.size += block.size
                before.next = block.next
                if block.next is not None:
                    block.next.prev = before
                block = before
            after = block.next
            if after is not None and not after.allocated and after.mapped:
                pool.remove(after)
                block.size += after.size
                block.next = after.next
                if after.next is not None:
                    after.next.prev = block
            pool.put(block)

    def empty_cache(self) -> None:
        """Release every segment no tensor uses any more (`torch.cuda.empty_cache`)."""
        with self.lock:
            kept = []
            for head in self.segments:
                if head.prev is None and head.next is None and not head.allocated:
                    self.pools[(head.small, head.stream)].remove(head)
                    self.unreserve_segment(head)
                else:
                    kept.append(head)
            if len(kept) < len(self.segments):  # the card has them back, for every process of the node
                node_memory.publish(self.node, self.reserved + self.outside_bytes)
            self.segments = kept
            if self.expandables:
                configured.release_expandable(self)

    # -- the storages (see "the storages of simulated CUDA tensors" below) --------------------------

    def limit(self) -> int:
        """The most this process may reserve on the card: what its context and the node's other processes
        leave, or its allowed fraction."""
        limit = self.model.total_memory - self.outside_bytes - node_memory.others(self.node)
        if self.fraction < 1.0:
            limit = min(limit, int(self.model.total_memory * self.fraction))
        return limit

    def note_alloc(self, key: int, nbytes: int) -> None:
        """Storage `key` of `nbytes` was made (raises out-of-memory if the card cannot hold it)."""
        block = _allocate(self, nbytes)
        if block is not None:
            self.blocks[key] = block

    def note_block(self, key: int, block: Block) -> None:
        """Storage `key` got `block`, allocated already (`reserve`)."""
        self.blocks[key] = block

    def note_free(self, key: int) -> None:
        """Storage `key` is gone."""
        block = self.blocks.pop(key, None)
        if block is not None:
            self.free(block)

    def note_resize(self, key: int, new: int) -> None:
        """Storage `key` grows or shrinks to `new` bytes: the new block first (out of memory first)."""
        block = _allocate(self, new) if new else None
        self.note_free(key)
        if block is not None:
            self.blocks[key] = block

    # -- reports ---------------------------------------------------------------------------------

    def oom_message(self, alloc: int) -> str:
        """CUDA's out-of-memory message for a segment of `alloc` bytes that does not fit."""
        total = self.model.total_memory
        allowed = ""
        if self.fraction < 1.0:
            allowed = f"{format_size(int(total * self.fraction))} allowed; "
        return (
            f"CUDA out of memory. Tried to allocate {format_size(alloc)}. GPU {self.index} has a total capacity of "
            f"{format_size(total)} of which {format_size(self.free_memory())} is free. "
            f"{node_memory.report(self.node, format_size)}Including "  # the node's other processes on it first
            f"non-PyTorch memory, this process has {format_size(self.reserved + self.outside_bytes)} memory "
            f"in use. {allowed}Of the allocated memory {format_size(self.allocated)} is allocated by PyTorch, and "
            f"{format_size(self.reserved - self.allocated)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
        )

    def nested_stats(self) -> dict[str, Any]:
        """What `torch._C._cuda_memoryStats` returns: the nested form `torch.cuda.memory_stats` flattens."""
        with self.lock:
            splits = self._inactive_splits()
            out: dict[str, Any] = {}
            for name in _STATS:
                source = {"active_bytes": "allocated_bytes", "active": "allocation"}.get(name, name)
                if name in ("inactive_split", "inactive_split_bytes"):
                    # computed from the pools when asked (only their current value is kept)
                    out[name] = {
                        pool: {
                            "current": splits[(name, pool)],
                            "peak": splits[(name, pool)],
                            "allocated": 0,
                            "freed": 0,
                        }
                        for pool in splits_pools
                    }
                else:
                    out[name] = {pool: self.stats[(source, pool)].as_dict() for pool in ("all", *_POOLS)}
            out.update(self.counters)
            out["num_sync_all_streams"] = 0
            out["num_oom_rejections"] = 0
            out.update({name: stat.as_dict() for name, stat in self.oversize.items()})
            out["max_split_size"] = self.max_split_stat
            return out

    def _inactive_splits(self) -> dict[tuple[str, str], int]:
        """Free blocks that are pieces of split segments, and their bytes, per pool."""
        found = {(name, pool): 0 for name in ("inactive_split", "inactive_split_bytes") for pool in splits_pools}
        for (small, _), pool in self.pools.items():
            for size, _, block in pool.free:
                # (torch leaves blocks of expandable segments out: their free pages can always be given back)
                if (block.prev is not None or block.next is not None) and block.segment is None:
                    for where in ("all", _POOLS[0] if small else _POOLS[1]):
                        found[("inactive_split", where)] += 1
                        found[("inactive_split_bytes", where)] += size
        return found

    def reset_peaks(self) -> None:
        """`reset_peak_memory_stats`: peaks back to the current values (the whole run's kept aside)."""
        with self.lock:
            for name, earlier in self.earlier_peaks.items():
                self.earlier_peaks[name] = max(earlier, self.stats[(f"{name}_bytes", "all")].peak)
            for stat in (*self.stats.values(), *self.oversize.values()):
                stat.peak = stat.current

    def run_peak(self, name: str) -> int:
        """The whole run's peak of "allocated" or "reserved" bytes, whatever peak resets came between."""
        return max(self.earlier_peaks[name], self.stats[(f"{name}_bytes", "all")].peak)

    def reset_accumulated(self) -> None:
        with self.lock:
            for stat in (*self.stats.values(), *self.oversize.values()):
                stat.allocated = stat.freed = 0
            for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
                self.counters[key] = 0

    def segment_snapshot(self) -> list[dict[str, Any]]:
        """`torch.cuda.memory_snapshot()`'s segments, by address: sizes and blocks of each (of an expandable
        segment, each run of mapped pages)."""
        with self.lock:
            found = [self.segment_entry(list(_chain(head)), head.small) for head in self.segments]
            if self.expandables:
                found = sorted(found + configured.expandable_snapshot(self), key=lambda entry: entry["address"])
            return found

    def segment_entry(self, blocks: list[Block], small: bool, expandable: bool = False) -> dict[str, Any]:
        """One segment of `memory_snapshot()`: its `blocks`, in address order."""
        return {
            "device": self.index,
            "address": blocks[0].addr,
            "total_size": sum(b.size for b in blocks),
            "allocated_size": sum(b.size for b in blocks if b.allocated),
            "active_size": sum(b.size for b in blocks if b.allocated),
            "requested_size": sum(b.requested for b in blocks if b.allocated),
            "stream": blocks[0].stream,
            "segment_type": "small" if small else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": expandable,
            "frames": [],
            "blocks": [
                {
                    "address": b.addr,
                    "size": b.size,
                    "requested_size": b.requested,
                    "state": "active_allocated" if b.allocated else "inactive",
                    "frames": [],
                }
                for b in blocks
            ],
        }


def _chain(head: Block) -> Iterator[Block]:
    block: Block | None = head
    while block is not None:
        yield block
        block = block.next


# -- the storages of simulated CUDA tensors --------------------------------------------------------

#: the allocator of each simulated GPU of this rank (index -> DeviceMemory); empty: counting off
_devices: list[DeviceMemory] = []
#: StorageImpl address -> [its device's allocator, its size in bytes, a weak reference to the
#: storage]; the entry leaves when the storage is freed (the reference's callback)
_live: dict[int, list[Any]] = {}


#: what follows the allocators of the rank (the memory report, `follow_starts`): told when they start and stop
_followers: list[tuple[Callable[[list[DeviceMemory]], None], Callable[[], None]]] = []


def follow_starts(on_start: Callable[[list[DeviceMemory]], None], on_stop: Callable[[], None]) -> None:
    """Have `on_start(devices)` called whenever CUDA starts in the rank, and `on_stop()` when counting stops.

    How a room above the allocator (the memory report) follows it without the allocator naming it.
    """
    if (on_start, on_stop) not in _followers:
        _followers.append((on_start, on_stop))


def card() -> GpuModel:
    """The card this rank's simulated GPUs are (the memory model's, once CUDA started; else the environment's)."""
    if is_counting():
        return device(0).model
    return gpu_models.resolve()


def install(model: GpuModel, count: int) -> None:
    """Give this rank `count` simulated GPUs of `model`, their memory empty, under the allocator settings
    of the environment (invalid ones raise torch's error, and memory is not counted)."""
    try:
        settings = alloc_config.start()
    except Exception:
        uninstall()
        raise
    _devices[:] = [DeviceMemory(index, model, settings) for index in range(count)]
    for on_start, _ in _followers:
        on_start(_devices)
    if not _serving:
        torch_internals.serve_allocator_settings(_set_allocator_settings, lambda: alloc_config.current().text)
        _serving.append(True)
    gpus = cuda_state.current()
    for memory, seat in zip(_devices, node_memory.seats(gpus.visible if gpus else range(count)), strict=True):
        memory.node = seat  # the host GPU behind it, which the node's processes share
    _paused.clear()
    _live.clear()


def uninstall() -> None:
    """Stop counting (simulated GPUs keep working, their memory is not counted)."""
    node_memory.start_afresh()
    for _, on_stop in _followers:
        on_stop()
    _devices.clear()
    _paused.clear()
    _live.clear()


#: whether torch's run-time allocator settings come here (`install`)
_serving: list[bool] = []


def _set_allocator_settings(text: str) -> None:
    """`torch.cuda.memory._set_allocator_settings(text)`: the allocators follow the new settings at once."""
    settings = alloc_config.set_at_run_time(text, started=bool(_devices or _paused))
    for memory in (*_devices, *_paused):
        memory.configure(settings)


#: the allocators set aside while Dynamo compiles (`pause`)
_paused: list[DeviceMemory] = []


def pause() -> None:
    """Count no new storage until `resume`: Dynamo traces on fake tensors, which take no GPU memory."""
    if _devices and not _paused:
        _paused[:] = _devices
        _devices.clear()


def resume() -> None:
    """Count again what `pause` set aside."""
    if _paused:
        _devices[:] = _paused
        _paused.clear()


def device(index: int) -> DeviceMemory:
    """The allocator of simulated GPU `index` (raises when memory is not counted)."""
    if not _devices:
        raise RuntimeError("simulated GPU memory is not being counted in this process")
    return _devices[index]


def is_counting() -> bool:
    return bool(_devices)


def counts_memory() -> bool:
    """Whether this process counts its simulated GPUs' memory (paused while Dynamo compiles or not)."""
    return bool(_devices or _paused)


def counting_list() -> list[DeviceMemory]:
    """The list of allocators itself (changed in place): a cheap truth test for callers on hot paths."""
    return _devices


#: out-of-memory met inside backward, raised when backward returns (`raise_pending`)
_pending: list[torch.OutOfMemoryError] = []


def _allocate(memory: DeviceMemory, nbytes: int) -> Block | None:
    try:
        block = memory.malloc(nbytes)
        if memory.history is not None and block is not None:
            memory.history.allocated(block, nbytes)
        return block
    except torch.OutOfMemoryError as error:
        if memory.tracking is not None:
            memory.tracking.out_of_memory(nbytes)
        if not torch_internals.in_backward():
            raise
        # Raised inside the autograd engine, the error would abort the process (see
        # `torch_internals.in_backward`): the rest of backward runs, uncounted, and the
        # error is raised as backward returns, where code that catches it expects it.
        if not _pending:
            _pending.append(error)
        return None


def raise_pending() -> None:
    """Raise the out-of-memory error met during the backward that just returned, if any."""
    if _pending:
        error = _pending.pop()
        _pending.clear()
        try:
            raise error
        finally:
            # A local naming the error makes a cycle (error -> traceback -> this frame -> error) that
            # keeps every frame of the backward, and the graph and activations they hold, alive until
            # the garbage collector runs; a real GPU's error, raised in C++, frees them at once.
            del error


def reserve(index: int, nbytes: int) -> Block | None:
    """Before the host allocates `nbytes` for GPU `index`: the block (raises out-of-memory first).

    Hand the block to `track` with the storage made for it, or to `unreserve` if none was.
    """
    if not _devices:
        return None
    return _allocate(_devices[index], nbytes)


def unreserve(index: int, block: Block | None) -> None:
    """Give back a block `reserve` took for a storage that was never made."""
    if block is not None and _devices:
        _devices[index].free(block)


def _released(ref: Any) -> None:
    # the weak reference's callback: its storage is gone (a newer entry under the same key is not its)
    entry = _live.get(ref.key)
    if entry is None or entry[2] is not ref:
        return
    del _live[ref.key]
    entry[0].note_free(ref.key)
    if entry[0].tracking is not None:
        entry[0].tracking.removed(ref.key)


class _StorageRef(weakref.ref):
    __slots__ = ("key",)
    key: int


def track(inner: torch.Tensor, index: int, reserved: Block | None = None) -> None:
    """Count the storage of `inner` (now held by a tensor on GPU `index`) once, until it is freed.

    `reserved` is the block `reserve` took for it. Raises out-of-memory if it cannot fit.
    """
    if not _devices or inner.layout is not torch.strided or torch_internals.is_fake(inner):
        return  # a fake tensor (torch.export and Dynamo trace on them) holds no GPU memory
    storage = inner.untyped_storage()
    key = storage._cdata
    memory = _devices[index]
    entry = _live.get(key)
    if entry is not None and entry[0] is memory:
        if reserved is not None:
            memory.free(reserved)
        return
    nbytes = storage.nbytes()
    if reserved is not None and reserved.requested != nbytes:
        memory.free(reserved)
        reserved = None
    if reserved is not None:
        memory.note_block(key, reserved)
    else:
        memory.note_alloc(key, nbytes)
    ref = _StorageRef(storage, _released)
    ref.key = key
    _live[key] = [memory, nbytes, ref]
    if memory.tracking is not None:
        memory.tracking.added(key)


def holder(key: int) -> DeviceMemory | None:
    """The allocator that counts the storage of `key`, if one does."""
    entry = _live.get(key)
    return entry[0] if entry is not None else None


def resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Before `storage.resize_(nbytes)` of a counted storage: its block is replaced (out of memory first)."""
    entry = _live.get(storage._cdata)
    if entry is None or entry[1] == nbytes:
        return
    entry[0].note_resize(storage._cdata, nbytes)
    entry[1] = nbytes
    if entry[0].tracking is not None:
        entry[0].tracking.resized(storage._cdata)


def follow(inner: torch.Tensor) -> None:
    """After an op resized `inner` in place (resize_, out=): count its storage's new size."""
    if not _devices or inner.layout is not torch.strided or torch_internals.is_fake(inner):
        return  # a fake tensor (torch.export and Dynamo trace on them) holds no GPU memory
    storage = inner.untyped_storage()
    resize(storage, storage.nbytes())


def note_communicator(index: int, owner: object) -> None:
    """An NCCL communicator was set up on GPU `index` for `owner` (a group): its memory, outside PyTorch's."""
    if not _devices:
        return
    memory = _devices[index]
    first, further = memory.model.nccl_memory
    communicators = sum(1 for key in memory.outside if isinstance(key, tuple) and key[0] == "nccl")
    memory.note_outside(("nccl", id(owner)), further if communicators else first)
