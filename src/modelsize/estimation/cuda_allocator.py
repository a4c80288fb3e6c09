"""PyTorch's CUDA caching allocator, replayed on a sequence of allocations and frees.

``torch.cuda.max_memory_allocated()`` is the peak of the allocator's ``allocated_bytes``
statistic, which counts the *blocks* it hands out, not the bytes asked for. A block is at
least the request rounded up to 512 bytes, and sometimes much more: this module follows
``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.11, default
settings: no ``expandable_segments``, no ``max_split_size_mb``, no
``roundup_power2_divisions``, one stream):

* ``round_size``: a request becomes a multiple of 512 bytes (``kMinBlockSize``); a request
  of 0 bytes allocates nothing;
* two pools: requests up to 1 MiB (``kSmallSize``) are served from the small pool, larger
  ones from the large pool;
* ``get_free_block``: the best fit, the smallest free block of the pool at least as large,
  ties broken by the lower address (the pool is ordered by ``(stream, size, address)``);
* without one, ``alloc_block`` maps a new segment of ``get_allocation_size``: 2 MiB for a
  small request, 20 MiB (``kLargeBuffer``) for one under 10 MiB, else the request rounded up
  to 2 MiB;
* ``should_split``: a block from the small pool is split when at least 512 bytes remain,
  one from the large pool only when **more than 1 MiB** remains: a 10.5 MiB request gets a
  whole 12 MiB segment (1.5 MiB more than asked), a request that finds a free block at most
  1 MiB larger gets all of it;
* ``free_block`` merges a freed block with its free neighbours of the same segment.

Segments are never released here: the runs this replays start with an emptied cache and no
``cudaMalloc`` fails, so ``release_cached_blocks`` never runs. Which address a new segment
gets is the driver's choice; segments are laid out in the order they are mapped, which
decides only between free blocks of exactly the same size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """``round_size``: the request rounded up to a multiple of 512 bytes (at least 512)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a rounded request maps when no block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class Block:
    """A piece of a segment: allocated or free, linked to its neighbours in the segment."""

    addr: int
    size: int
    small: bool
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None


@dataclass
class CachingAllocator:
    """The allocator's state: its free blocks by pool and its statistics.

    :meth:`malloc` returns a handle for :meth:`free`; ``allocated`` and ``peak`` are the
    ``allocated_bytes`` statistic (current and highest), ``requested`` the bytes asked for,
    ``reserved`` the bytes of the segments mapped so far, ``segments`` their sizes in order.
    """

    allocated: int = 0
    peak: int = 0
    requested: int = 0
    reserved: int = 0
    segments: list[int] = field(default_factory=list)
    _free: dict[bool, list[tuple[int, int, Block]]] = field(
        default_factory=lambda: {True: [], False: []})
    _next_addr: int = 0

    def malloc(self, nbytes: int) -> Block | None:
        """Allocate ``nbytes`` as the caching allocator would; None for 0 bytes."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        at = bisect.bisect_left(pool, (size, -1))
        if at < len(pool):
            block = pool.pop(at)[2]
        else:
            seg = allocation_size(size)
            block = Block(self._next_addr, seg, small)
            self._next_addr += seg
            self.reserved += seg
            self.segments.append(seg)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = Block(block.addr + size, remaining, small, False, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            bisect.insort(pool, (rest.size, rest.addr, rest))
        block.allocated = True
        self.allocated += block.size
        self.requested += nbytes
        if self.allocated > self.peak:
            self.peak = self.allocated
        return block

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release the segments that are wholly free."""
        for small in (True, False):
            pool = self._free[small]
            keep = [entry for entry in pool
                    if entry[2].prev is not None or entry[2].next is not None]
            self.reserved -= sum(e[0] for e in pool) - sum(e[0] for e in keep)
            pool[:] = keep

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: the peak restarts from the current."""
        self.peak = self.allocated

    def free(self, block: Block | None, nbytes: int = 0) -> None:
        """Return ``block`` to its pool, merged with free neighbours (None: nothing)."""
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        self.requested -= nbytes
        pool = self._free[block.small]
        for other in (block.prev, block.next):
            if other is None or other.allocated:
                continue
            del pool[bisect.bisect_left(pool, (other.size, other.addr))]
            if other is block.prev:
                block.addr = other.addr
                block.prev = other.prev
                if other.prev is not None:
                    other.prev.next = block
            else:
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
            block.size += other.size
        bisect.insort(pool, (block.size, block.addr, block))
