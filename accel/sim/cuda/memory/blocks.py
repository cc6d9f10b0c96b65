"""The caching allocator's blocks and pools: the pieces of memory it hands out and keeps.

A block is a run of a segment taken from the driver, allocated to one storage or cached free;
a pool holds the free blocks of one size class (small or large) of one stream, sorted by size,
as c10/cuda/CUDACachingAllocator.cpp's `BlockPool`. Shared by the default rules (`allocator`)
and the rules settings change (`configured`), so it sits below both.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accel.sim.cuda.memory import configured


class Block:
    """A run of a segment: allocated to one storage, or free."""

    __slots__ = (
        "size", "addr", "small", "prev", "next", "allocated", "requested", "segment_size", "segment", "mapped",
        "gc_base", "stream",
    )  # fmt: skip

    def __init__(self, size: int, addr: int, small: bool) -> None:
        self.size = size
        self.addr = addr
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.requested = 0
        self.segment_size = 0  # on a segment's first block: the segment's size
        #: the expandable segment the block is part of (None: a segment of its own, `configured`)
        self.segment: configured.Expandable | None = None
        #: whether pages back it (only a block of an expandable segment may have none)
        self.mapped = True
        self.gc_base = 0  # the pool's request count when the block was cached (its age, `configured`)
        #: the stream it was allocated on (`fake.Stream.sim_id`): only requests on that stream reuse it,
        #: as torch's pools are keyed by stream first
        self.stream = 0


@dataclasses.dataclass
class Pool:
    free: list[tuple[int, int, Block]] = dataclasses.field(default_factory=list)  # (size, addr, block), sorted
    #: blocks of expandable segments without pages, (addr, block), sorted
    unmapped: list[tuple[int, Block]] = dataclasses.field(default_factory=list)
    #: requests served from the pool while garbage collection is on (the age of its blocks), shared by the
    #: pools of all streams (torch's one BlockPool per size class holds every stream's blocks)
    counter: list[int] = dataclasses.field(default_factory=lambda: [0])

    @property
    def calls(self) -> int:
        return self.counter[0]

    @calls.setter
    def calls(self, value: int) -> None:
        self.counter[0] = value

    def take(self, size: int) -> Block | None:
        i = bisect.bisect_left(self.free, (size, -1))
        if i == len(self.free):
            return None
        return self.free.pop(i)[2]

    def put(self, block: Block) -> None:
        block.gc_base = self.calls
        bisect.insort(self.free, (block.size, block.addr, block))

    def remove(self, block: Block) -> None:
        i = bisect.bisect_left(self.free, (block.size, block.addr))
        del self.free[i]
