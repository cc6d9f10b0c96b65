"""The simulated caching allocator under settings (`accel.sim.cuda.memory.settings`): the rules they change.

`accel.sim.cuda.memory.allocator` serves requests by its default rules while nothing changes them;
once settings do (``expandable_segments``, ``max_split_size_mb``, ``roundup_power2_divisions``,
``garbage_collection_threshold``, ``large_segment_size_mb``), its requests come here. The
rules are those of c10/cuda/CUDACachingAllocator.cpp (`DeviceCachingAllocator::malloc`
and the functions it calls; names in brackets below):

* a request is rounded as the settings say (`round_size`); the smallest cached block that
  fits is taken (`get_free_block`), except that a request below max_split_size takes no
  block of max_split_size or more, and a request of max_split_size or more takes no block
  ``max_non_split_rounding_mb`` or more above it; blocks of expandable segments count as
  large as they can grow while expandable segments are on, and are passed over while off;
* with a memory fraction and a garbage collection threshold, a request no cached block
  serves first frees whole cached segments of the large pool whose age (requests since they
  were cached) is at least the average, until reserved memory is back under the threshold
  (`garbage_collect_cached_blocks`);
* then a new segment (`alloc_block`): with expandable segments, pages are mapped at the
  lowest address of the pool's segment that has room (a segment reserves address space for
  9/8 of the card and maps 2 MiB pages in the small pool, large_segment_size pages in the
  large one: `find_expandable_block`, `map_block`); reserved memory grows by the pages
  mapped, the segment count does not; if that fails, oversize cached segments are freed
  (`release_available_cached_blocks`), then every cached one (empty_cache, with a retry
  counted), and out-of-memory is raised;
* a block is split when what is left is worth keeping: 512 bytes in the small pool and in
  expandable segments, more than 1 MiB in the large pool and only for requests below
  max_split_size (`should_split`);
* `empty_cache` unmaps the whole free pages of expandable segments, and gives a segment back
  once none of it is mapped (`release_blocks`, `unmap_block`).

Blocks of expandable segments are not counted as inactive splits (as torch counts them);
oversize blocks and segments are counted in ``oversize_allocations`` / ``oversize_segments``.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from accel.sim.cuda.memory import node as node_memory
from accel.sim.cuda.memory.blocks import Block
from accel.sim.cuda.memory.settings import K_MIN_BLOCK, K_SMALL_BUFFER, K_SMALL_SIZE, SIZE_MAX

if TYPE_CHECKING:
    from accel.sim.cuda.memory.allocator import DeviceMemory
    from accel.sim.cuda.memory.blocks import Pool


class Expandable:
    """An expandable segment: address space for 9/8 of the card, mapped page by page."""

    __slots__ = ("page", "base", "size", "small", "head")

    def __init__(self, page: int, base: int, size: int, small: bool) -> None:
        self.page = page
        self.base = base
        self.size = size
        self.small = small
        self.head: Block | None = None  # the block at its first address (it stays the first)


def malloc(memory: DeviceMemory, nbytes: int) -> Block:
    """A block for a request of `nbytes` (> 0) under the settings (the allocator's lock is held)."""
    conf = memory.conf
    size = conf.round_size(nbytes)
    small = size <= K_SMALL_SIZE
    stream = memory.current_stream()
    pool = memory.pool(small, stream)
    expandable = conf.expandable_segments
    block = _find_free(memory, pool, size, expandable)
    if block is None:
        if conf.garbage_collection_threshold > 0.0 and memory.fraction < 1.0:
            collect_garbage(memory)
        block = _allocate(memory, pool, size, small, expandable)
        if block.segment is None:
            block.stream = stream  # (an expandable segment's blocks have its stream: `_room_for`)
    remaining = block.size - size
    if remaining >= K_MIN_BLOCK if small or expandable else size < memory.mss and remaining > K_SMALL_SIZE:
        pool.put(memory.split(block, size))
    block.allocated = True
    block.requested = nbytes
    memory._book(small, block.size, nbytes, 1)
    if block.size >= memory.mss:
        memory.oversize["oversize_allocations"].add(1)
    return block


def _grows_to(block: Block) -> int:
    """What a free block of an expandable segment can grow to: itself and the unmapped pages after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


def _find_free(memory: DeviceMemory, pool: Pool, size: int, expandable: bool) -> Block | None:
    """The cached block that serves `size` bytes (`get_free_block`), taken out of the pool; None if none does."""
    if memory.fraction < 1.0 and memory.conf.garbage_collection_threshold > 0.0:
        pool.calls += 1  # the blocks' age, for the garbage collection
    free = pool.free
    i = bisect.bisect_left(free, (size, -1))
    if i == len(free):
        return None
    if free[i][2].segment is not None:
        if expandable:
            while (
                i + 1 < len(free)
                and free[i][2].segment is not None
                and _grows_to(free[i + 1][2]) < _grows_to(free[i][2])
            ):
                i += 1
        else:  # expandable segments turned off: only other blocks serve
            while i < len(free) and free[i][2].segment is not None:
                i += 1
            if i == len(free):
                return None
    block = free[i][2]
    limit, rounding = memory.mss, memory.conf.max_non_split_rounding_size
    if size < limit <= block.size or (size >= limit and block.size >= size + rounding):
        return None
    del free[i]
    return block


def _allocate(memory: DeviceMemory, pool: Pool, size: int, small: bool, expandable: bool) -> Block:
    """New memory for `size` bytes: tried, then after freeing oversize cached segments, then all (`malloc`)."""
    alloc = memory.conf.allocation_size(size)
    block = _new_block(memory, pool, size, small, alloc, expandable)
    if block is None and release_available(memory, pool, size):
        block = _new_block(memory, pool, size, small, alloc, expandable)
    if block is None:
        memory.counters["num_alloc_retries"] += 1
        memory.empty_cache()
        block = _new_block(memory, pool, size, small, alloc, expandable)
    if block is None:
        raise memory.out_of_memory(size, alloc)
    return block


def _new_block(memory: DeviceMemory, pool: Pool, size: int, small: bool, alloc: int, expandable: bool) -> Block | None:
    """A segment of `alloc` bytes, or pages of an expandable segment (`alloc_block`); None if the card is full."""
    if memory.fraction < 1.0 and memory.reserved + alloc > int(memory.model.total_memory * memory.fraction):
        return None  # the allowed fraction is checked against a whole segment's size, even for pages
    if expandable:
        return _grow(memory, pool, size, small)
    if not memory._fits(alloc):
        return None
    return memory.new_segment_block(alloc, small)


# -- expandable segments ----------------------------------------------------------------------------------


def _grow(memory: DeviceMemory, pool: Pool, size: int, small: bool) -> Block | None:
    """A free block of `size` bytes or more, pages mapped at the lowest address with room
    (`try_allocate_expandable_block`)."""
    candidate = _room_for(memory, pool, size, small, memory.current_stream())
    if candidate is None:
        return None
    if not candidate.mapped:
        candidate = _map(memory, pool, candidate, min(candidate.size, size))
    while candidate is not None and candidate.size < size:
        following = candidate.next  # the unmapped pages after it
        assert following is not None and not following.mapped
        candidate = _map(memory, pool, following, min(size - candidate.size, following.size))
    if candidate is None:
        return None
    pool.remove(candidate)
    return candidate


def _room_for(memory: DeviceMemory, pool: Pool, size: int, small: bool, stream: int) -> Block | None:
    """The first block (free or unmapped, lowest address first) from which `size` bytes of free and unmapped
    memory follow; in a new segment if none (`find_expandable_block`); None if a whole segment is too small.
    The pool is `stream`'s: each stream has expandable segments of its own, as torch's."""
    for _, unmapped in pool.unmapped:
        start = unmapped.prev if unmapped.prev is not None and not unmapped.prev.allocated else unmapped
        room, block = 0, start  # type: tuple[int, Block | None]
        while room < size and block is not None and not block.allocated:
            room += block.size
            block = block.next
        if room >= size:
            return start
    page = K_SMALL_BUFFER if small else memory.conf.large_segment_size
    total = memory.model.total_memory
    reach = page * -(-(total + total // 8) // page)
    if reach < size:
        return None
    base = next(memory._addresses)
    for _ in range(reach >> 40):  # one address range each: a segment must not run into the next
        next(memory._addresses)
    segment = Expandable(page, base, reach, small)
    head = Block(reach, base, small)
    head.segment, head.mapped, head.stream = segment, False, stream
    segment.head = head
    memory.expandables.append(segment)
    put_unmapped(pool, head)
    return head


def put_unmapped(pool: Pool, block: Block) -> None:
    """Keep unmapped `block` in its pool's list of unmapped blocks, by address (where pages are mapped first)."""
    bisect.insort(pool.unmapped, (block.addr, block))


def _take_unmapped(pool: Pool, block: Block) -> None:
    del pool.unmapped[bisect.bisect_left(pool.unmapped, (block.addr,))]


def _map(memory: DeviceMemory, pool: Pool, block: Block, nbytes: int) -> Block | None:
    """Map the pages that cover the first `nbytes` of unmapped `block` (`map_block`); the free block they
    are now part of (merged with free neighbours), or None if the card has no room for them."""
    segment = block.segment
    assert segment is not None
    mapped = segment.page * -(-nbytes // segment.page)
    if not memory._fits(mapped):
        return None
    _take_unmapped(pool, block)
    if mapped < block.size:
        put_unmapped(pool, memory.split(block, mapped))
    block.mapped = True
    if memory.history is not None:
        memory.history.segment("segment_map", block.addr, mapped, block.stream)
    block = _merge(pool, block)
    pool.put(block)
    memory._count("reserved_bytes", block.small, mapped)
    memory.counters["num_device_alloc"] += 1
    if "kernels" not in memory.outside:  # the first allocation: its kernels are the first launched
        memory.note_outside("kernels", memory.model.kernels_memory)
    return block


def _merge(pool: Pool, block: Block) -> Block:
    """`block` (in no list) joined with the neighbours of its kind (free and mapped, or unmapped), which leave
    their lists; the lower block takes the higher in, so a segment's first block stays its first."""
    before = block.prev
    if before is not None and not before.allocated and before.mapped == block.mapped:
        pool.remove(before) if before.mapped else _take_unmapped(pool, before)
        _absorb(before, block)
        block = before
    after = block.next
    if after is not None and not after.allocated and after.mapped == block.mapped:
        pool.remove(after) if after.mapped else _take_unmapped(pool, after)
        _absorb(block, after)
    return block


def _absorb(keep: Block, gone: Block) -> None:
    keep.size += gone.size
    keep.next = gone.next
    if gone.next is not None:
        gone.next.prev = keep


def release_expandable(memory: DeviceMemory) -> None:
    """`empty_cache`: unmap the whole free pages of expandable segments; give back segments left unmapped."""
    unmapped = False
    for pool in memory.pools.values():
        for _, _, block in [entry for entry in pool.free if entry[2].segment is not None]:
            unmapped |= _unmap(memory, pool, block)
    if unmapped:
        node_memory.publish(memory.node, memory.reserved + memory.outside_bytes)


def _unmap(memory: DeviceMemory, pool: Pool, block: Block) -> bool:
    """Unmap the pages wholly inside free `block` (`unmap_block`); whether there were any."""
    segment = block.segment
    assert segment is not None
    offset = block.addr - segment.base
    first, last = -(-offset // segment.page), (offset + block.size) // segment.page
    if first >= last:
        return False
    start, length = segment.base + first * segment.page, (last - first) * segment.page
    pool.remove(block)
    pages = block
    if start > block.addr:
        pages = memory.split(block, start - block.addr)
        pool.put(block)
    if pages.size > length:
        pool.put(memory.split(pages, length))
    pages.mapped = False
    if memory.history is not None:
        memory.history.segment("segment_unmap", start, length, pages.stream)
    pages = _merge(pool, pages)
    memory._count("reserved_bytes", pages.small, -length)
    memory.counters["num_device_free"] += 1
    if pages.prev is None and pages.next is None:  # nothing of the segment is mapped: it goes
        memory.expandables.remove(segment)
    else:
        put_unmapped(pool, pages)
    return True


# -- giving cached segments back before out-of-memory -------------------------------------------------------


def _whole(block: Block) -> bool:
    """Whether cached `block` is a whole segment of its own (not of an expandable one): cudaFree can take it."""
    return block.prev is None and block.next is None and block.segment is None


def release_segment(memory: DeviceMemory, head: Block) -> None:
    """Give whole cached segment `head` back to the card (`release_block`)."""
    memory.pools[(head.small, head.stream)].remove(head)
    memory.segments.remove(head)
    memory.unreserve_segment(head)
    node_memory.publish(memory.node, memory.reserved + memory.outside_bytes)


def release_available(memory: DeviceMemory, pool: Pool, size: int) -> bool:
    """Free cached oversize segments, the smallest one of at least `size` (and max_split_size) bytes, else the
    largest ones until as much is freed (`release_available_cached_blocks`); whether that was done."""
    limit = memory.mss
    if limit == SIZE_MAX:
        return False
    wanted = max(size, limit)
    free = pool.free
    i = bisect.bisect_left(free, (wanted, -1))
    if i < len(free) and free[i][2].segment is None:
        if not _whole(free[i][2]):
            return False
        release_segment(memory, free[i][2])
        return True
    released = 0
    for _, _, block in reversed(free[:i]):
        if released >= wanted or block.size < limit:
            break
        if _whole(block):
            released += block.size
            release_segment(memory, block)
    return released >= wanted


def collect_garbage(memory: DeviceMemory) -> None:
    """Free cached whole segments of the large pool, oldest first, while reserved memory is above the
    threshold's share of the allowed memory (`garbage_collect_cached_blocks`)."""
    allowed = int(memory.model.total_memory * memory.fraction)
    threshold = int(memory.conf.garbage_collection_threshold * allowed)
    if memory.reserved <= threshold:
        return
    target, reclaimed = memory.reserved - threshold, 0
    # every stream's large blocks, by stream (torch's pool orders its blocks by stream first)
    pools = [pool for (small, _), pool in sorted(memory.pools.items(), key=lambda item: item[0][1]) if not small]
    calls = memory.pool(False, 0).calls  # (shared by the pools of all streams)
    candidates = [block for pool in pools for _, _, block in pool.free if _whole(block)]
    total_age, count = sum(calls - block.gc_base for block in candidates), len(candidates)
    freed = True
    while reclaimed < target and freed and count > 0:
        average, freed = total_age / count, False
        for block in [block for pool in pools for _, _, block in pool.free]:
            age = calls - block.gc_base
            if _whole(block) and age >= average:
                freed, reclaimed, total_age, count = True, reclaimed + block.size, total_age - age, count - 1
                release_segment(memory, block)


def expandable_snapshot(memory: DeviceMemory) -> list[dict[str, Any]]:
    """`memory_snapshot()` of the expandable segments: one segment per run of mapped pages, as torch reports them."""
    found = []
    for segment in memory.expandables:
        block = segment.head
        while block is not None:
            if block.mapped and (block.prev is None or not block.prev.mapped):
                run = []
                while block is not None and block.mapped:
                    run.append(block)
                    block = block.next
                found.append(memory.segment_entry(run, segment.small, expandable=True))
            else:
                block = block.next
    return found
