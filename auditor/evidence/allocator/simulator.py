"""A simulated CUDA caching allocator for one device, following DeviceCachingAllocator
(c10/cuda/CUDACachingAllocator.cpp) decision for decision:
- malloc: round the request, pick the pool (small: <= 1 MiB), take the best fitting cached block
  of the same stream (smallest, then lowest address), with torch's limits on oversize blocks
  (max_split_size); else garbage-collect (when configured), cudaMalloc a segment, free oversize
  cached blocks and retry, then free every unsplit cached block and retry; failing all, an OOM.
- split: the rest of a found block is split off when >= 512 B (small pool, expandable segments)
  or, in the large pool, when the request is under max_split_size and the rest exceeds 1 MiB.
- free: a block returns to its pool when its free completes, merging with free neighbours; one
  still in use by another stream stays out until then.
- expandable segments: one growable segment per stream and pool, mapped in 2 MiB (small) or
  20 MiB (large) pages at the lowest address with room; releasing the cache unmaps free pages.
The device holds `capacity` bytes for this process: a cudaMalloc or mapping past it fails.
auditor.evidence.allocator.replay drives it with a snapshot's requests. Each step of malloc in
torch's order: bench/HISTORY.md, "auditor/evidence/allocator/simulator.py".
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from typing import Callable

from auditor.evidence.allocator.config import (K_LARGE_BUFFER, K_MIN_BLOCK, K_SMALL_BUFFER, K_SMALL_SIZE,
                                               AllocatorConfig, allocation_size, round_size)

SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = "segment_alloc", "segment_free", "segment_map", "segment_unmap"
RETRY, OOM = "retry", "oom"  # release_cached_blocks after a failed cudaMalloc; a request that failed for good


class Blk:
    """A block: a piece of a segment, free or handed out (CUDACachingAllocator's Block)."""

    __slots__ = ("stream", "size", "ptr", "small", "seg", "mapped", "allocated", "pending", "prev", "next",
                 "requested", "rec", "gc_base")

    def __init__(self, stream: int, size: int, ptr: int, small: bool, seg: "Expandable | None" = None,
                 mapped: bool = True) -> None:
        self.stream, self.size, self.ptr, self.small, self.seg, self.mapped = stream, size, ptr, small, seg, mapped
        self.allocated = False
        self.pending = False  # freed by the program, awaiting another stream (not reusable yet)
        self.prev: Blk | None = None
        self.next: Blk | None = None
        self.requested = 0
        self.rec = -1  # the recorded address the driver knows this allocation by
        self.gc_base = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Expandable:
    """An expandable segment: a virtual range of one stream and pool, mapped page by page."""

    __slots__ = ("base", "size", "page", "stream", "small")

    def __init__(self, base: int, size: int, page: int, stream: int, small: bool) -> None:
        self.base, self.size, self.page, self.stream, self.small = base, size, page, stream, small


class Pool:
    """Cached free blocks of one pool, ordered by (stream, size, address); unmapped ranges of
    expandable segments ordered by (stream, address)."""

    __slots__ = ("small", "keys", "blocks", "ukeys", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Blk] = {}
        self.ukeys: list[tuple[int, int]] = []
        self.unmapped: dict[tuple[int, int], Blk] = {}
        self.gc_calls = 0

    def insert(self, b: Blk) -> None:
        key = (b.stream, b.size, b.ptr)
        b.gc_base = self.gc_calls
        insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: Blk) -> None:
        key = (b.stream, b.size, b.ptr)
        if self.blocks.pop(key, None) is not None:
            del self.keys[bisect_left(self.keys, key)]

    def insert_unmapped(self, b: Blk) -> None:
        key = (b.stream, b.ptr)
        insort(self.ukeys, key)
        self.unmapped[key] = b

    def remove_unmapped(self, b: Blk) -> None:
        key = (b.stream, b.ptr)
        if self.unmapped.pop(key, None) is not None:
            del self.ukeys[bisect_left(self.ukeys, key)]


class Simulator:
    """One device's caching allocator. `capacity`: bytes the process may reserve on the device.
    `hints`: segment size -> addresses to give new segments, in order (a replay passes the
    recorded cudaMalloc addresses so ties between equal blocks break as they did)."""

    def __init__(self, cfg: AllocatorConfig, capacity: int,
                 hints: dict[int, deque[int]] | None = None, next_address: int = 1 << 48) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.limit = cfg.split_limit
        self.set_fraction = cfg.memory_fraction is not None
        self.allowed = int(capacity * cfg.memory_fraction) if cfg.memory_fraction is not None else capacity
        self.gc_on = self.set_fraction and cfg.garbage_collection_threshold > 0
        self.pools = {True: Pool(True), False: Pool(False)}
        self.pending: dict[int, Blk] = {}  # id -> block freed by the program, awaiting another stream
        self.hints = hints or {}
        self.next_address = next_address
        self.seg_starts: list[int] = []  # live cudaMalloc segments / expandable ranges, for address choice
        self.seg_ends: dict[int, int] = {}
        self.reserved = 0
        self.peak_reserved = 0
        self.peak_index = -1
        self.allocated = 0  # requested bytes of live allocations
        self.peak_allocated = 0
        self.segment_allocs = 0  # cudaMalloc calls and page mappings
        self.segment_frees = 0  # cudaFree calls and page unmappings
        self.retries = 0
        self.ooms = 0
        self.index = -1  # the driver's position (trace index), stamped on events
        # (index, kind, bytes, stream, address; -1 for a retry, the device's free bytes for an OOM)
        self.events: list[tuple[int, str, int, int, int]] = []
        self.on_event: Callable[[str, int, int], None] | None = None

    # ---------------------------------------------------------------------------------------------
    # bookkeeping

    def _event(self, kind: str, size: int, stream: int, addr: int = -1) -> None:
        self.events.append((self.index, kind, size, stream, addr))

    def _reserve(self, size: int) -> None:
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved, self.peak_index = self.reserved, self.index

    def _address(self, size: int) -> int:
        """An address for a new range of `size` bytes: the next hint that overlaps nothing live,
        else past everything handed out so far."""
        q = self.hints.get(size)
        while q:
            a = q.popleft()
            i = bisect_right(self.seg_starts, a)
            if i and self.seg_ends[self.seg_starts[i - 1]] > a:
                continue
            if i < len(self.seg_starts) and self.seg_starts[i] < a + size:
                continue
            self._take(a, size)
            return a
        a = self.next_address
        self.next_address += size + K_LARGE_BUFFER
        self._take(a, size)
        return a

    def _take(self, a: int, size: int) -> None:
        insort(self.seg_starts, a)
        self.seg_ends[a] = a + size
        self.next_address = max(self.next_address, a + size + K_LARGE_BUFFER)

    def _give_back(self, a: int) -> None:
        if self.seg_ends.pop(a, None) is not None:
            del self.seg_starts[bisect_left(self.seg_starts, a)]

    # ---------------------------------------------------------------------------------------------
    # seeding: segments that existed before the driver's first request

    def seed_segment(self, addr: int, size: int, stream: int, small: bool,
                     live: list[tuple[int, int, int, int]]) -> list[Blk]:
        """Adds a cudaMalloc segment holding `live` (ptr, block size, requested, recorded address)
        blocks, in address order; the gaps become free blocks. Returns the live blocks."""
        self._take(addr, size)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        pool = self.pools[small]
        pos, prev, out = addr, None, []
        end = addr + size
        pieces: list[tuple[int, int, bool, int, int]] = []
        for ptr, bsize, requested, rec in live:
            if ptr < pos or ptr >= end:
                continue
            if ptr > pos:
                pieces.append((pos, ptr - pos, False, 0, -1))
            bsize = min(bsize, end - ptr)
            pieces.append((ptr, bsize, True, requested, rec))
            pos = ptr + bsize
        if pos < end:
            pieces.append((pos, end - pos, False, 0, -1))
        for ptr, bsize, alive, requested, rec in pieces:
            b = Blk(stream, bsize, ptr, small)
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
            if alive:
                b.allocated, b.requested, b.rec = True, requested, rec
                self.allocated += requested
                out.append(b)
        for b in self._chain(addr, prev):
            if not b.allocated:
                pool.insert(b)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return out

    @staticmethod
    def _chain(addr: int, last: Blk | None) -> list[Blk]:
        out = []
        while last is not None:
            out.append(last)
            last = last.prev
        return out[::-1]

    # ---------------------------------------------------------------------------------------------
    # the program's requests

    def malloc(self, orig_size: int, stream: int) -> Blk:
        size = round_size(orig_size, self.cfg)
        small = size <= K_SMALL_SIZE
        pool = self.pools[small]
        alloc_size = allocation_size(size)
        b = self._get_free_block(pool, stream, size)
        if b is None:
            if self.gc_on:
                self._garbage_collect()
            b = self._alloc_block(pool, stream, size, alloc_size)
            if b is None and self._release_available(pool, stream, size):
                b = self._alloc_block(pool, stream, size, alloc_size)
            if b is None:
                self.retries += 1
                self._event(RETRY, orig_size, stream)
                self.release_cached_blocks()
                b = self._alloc_block(pool, stream, size, alloc_size)
            if b is None:  # torch raises "CUDA out of memory"; the replay goes on past the limit
                self.ooms += 1
                self._event(OOM, orig_size, stream, max(self.capacity - self.reserved, 0))  # (what CUDA had free)
                b = self._alloc_block(pool, stream, size, alloc_size, force=True)
                assert b is not None
        if self._should_split(b, size):
            rest = b
            b = Blk(stream, size, rest.ptr, small, rest.seg)
            b.prev = rest.prev
            if b.prev is not None:
                b.prev.next = b
            b.next = rest
            rest.prev = b
            rest.ptr += size
            rest.size -= size
            pool.insert(rest)
        b.allocated = True
        b.requested = orig_size
        self.allocated += orig_size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b

    def free_requested(self, b: Blk) -> None:
        """The program dropped the block; it becomes reusable when its free completes."""
        if b.allocated:
            b.allocated = False
            b.pending = True
            self.pending[id(b)] = b

    def free_completed(self, b: Blk) -> None:
        if b.allocated:
            self.free_requested(b)
        if b.pending:
            self._complete(b)

    def _complete(self, b: Blk) -> None:
        self.pending.pop(id(b), None)
        b.pending = False
        self.allocated -= b.requested
        self._free_block(b)

    # ---------------------------------------------------------------------------------------------
    # the allocator's decisions

    def _should_split(self, b: Blk, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.cfg.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.limit and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: Pool, stream: int, size: int) -> Blk | None:
        if self.gc_on:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, -1))
        n = len(keys)
        if i == n or keys[i][0] != stream:
            return None
        b = pool.blocks[keys[i]]
        if b.seg is not None:
            if self.cfg.expandable_segments:
                def grows_to(x: Blk) -> int:
                    nx = x.next
                    return x.size + (nx.size if nx is not None and not nx.mapped else 0)
                j = i + 1
                while b.seg is not None and j < n and keys[j][0] == stream:
                    c = pool.blocks[keys[j]]
                    if grows_to(c) >= grows_to(b):
                        break
                    b, j = c, j + 1
            else:
                j = i + 1
                while j < n and keys[j][0] == stream and pool.blocks[keys[j]].seg is not None:
                    j += 1
                if j == n or keys[j][0] != stream:
                    return None
                b = pool.blocks[keys[j]]
        if size < self.limit and b.size >= self.limit:
            return None
        if size >= self.limit and b.size >= size + K_LARGE_BUFFER:
            return None
        pool.remove(b)
        return b

    def _alloc_block(self, pool: Pool, stream: int, size: int, alloc_size: int, force: bool = False) -> Blk | None:
        if not force and self.set_fraction and self.reserved + alloc_size > self.allowed:
            return None
        if self.cfg.expandable_segments:
            return self._try_allocate_expandable(pool, stream, size, force)
        if not force and self.reserved + alloc_size > self.capacity:
            return None
        b = Blk(stream, alloc_size, self._address(alloc_size), pool.small)
        self._reserve(alloc_size)
        self.segment_allocs += 1
        self._event(SEGMENT_ALLOC, alloc_size, stream, b.ptr)
        return b

    def _release_available(self, pool: Pool, stream: int, size: int) -> bool:
        """Frees oversize cached blocks (>= max_split_size) until the request would fit."""
        if self.cfg.max_split_size is None:
            return False
        key_size = max(size, self.limit)
        keys = pool.keys
        i = bisect_left(keys, (stream, key_size, -1))
        if i < len(keys) and keys[i][0] == stream:
            b = pool.blocks[keys[i]]
            if b.is_split or b.seg is not None:
                return False
            self._release_block(b)
            return True
        released = 0
        i -= 1
        while released < key_size and i >= 0:
            b = pool.blocks[keys[i]]
            if b.size < self.limit or b.stream != stream:
                break
            i -= 1
            if b.is_split or b.seg is not None:
                continue
            released += b.size
            self._release_block(b)
        return released >= key_size

    def release_cached_blocks(self) -> None:
        """Synchronise (frees awaiting other streams complete), then return every unsplit cached
        block to CUDA and unmap the free pages of expandable segments (what empty_cache does)."""
        for b in list(self.pending.values()):
            self._complete(b)
        for small in (False, True):
            pool = self.pools[small]
            to_unmap = []
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None:
                    continue
                if b.seg is not None:
                    to_unmap.append(b)
                elif not b.is_split:
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if b.prev is None and b.next is None and not b.mapped:
                    pool.remove_unmapped(b)
                    self._give_back(b.ptr)

    def _release_block(self, b: Blk) -> None:
        pool = self.pools[b.small]
        pool.remove(b)
        self.reserved -= b.size
        self.segment_frees += 1
        self._give_back(b.ptr)
        self._event(SEGMENT_FREE, b.size, b.stream, b.ptr)

    def _free_block(self, b: Blk) -> None:
        pool = self.pools[b.small]
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert(b)

    def _merge(self, dst: Blk, src: Blk | None, pool: Pool) -> int:
        if src is None or src.allocated or src.pending or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _garbage_collect(self) -> None:
        """Frees cached unsplit large blocks of above-average age until the reserve is back under
        garbage_collection_threshold x the allowed memory (garbage_collect_cached_blocks)."""
        threshold = int(self.cfg.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.pools[False]
        freeable = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split and pool.blocks[k].seg is None]
        if not freeable:
            return
        total_age = sum(pool.gc_calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for key in list(pool.keys):
                b = pool.blocks.get(key)
                if b is None or b.is_split or b.seg is not None:
                    continue
                age = pool.gc_calls - b.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    # ---------------------------------------------------------------------------------------------
    # expandable segments

    def _allocatable(self, b: Blk | None) -> bool:
        return b is not None and not b.allocated and not b.pending

    def _find_expandable(self, pool: Pool, stream: int, size: int) -> Blk:
        ukeys = pool.ukeys
        i = bisect_left(ukeys, (stream, -1))
        while i < len(ukeys) and ukeys[i][0] == stream:
            c = pool.unmapped[ukeys[i]]
            i += 1
            if self._allocatable(c.prev):
                c = c.prev
            got, x = 0, c
            while got < size and self._allocatable(x):
                got += x.size
                x = x.next
            if got >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        span = -(-max(self.capacity + self.capacity // 8, size) // page) * page
        seg = Expandable(self._address(span), span, page, stream, pool.small)
        c = Blk(stream, span, seg.base, pool.small, seg, mapped=False)
        pool.insert_unmapped(c)
        return c

    def _map_block(self, b: Blk, size: int, force: bool) -> bool:
        seg = b.seg
        assert seg is not None
        begin = (b.ptr - seg.base) // seg.page
        end = -(-(b.ptr + size - seg.base) // seg.page)
        mapped = (end - begin) * seg.page
        if mapped == 0 or (not force and self.reserved + mapped > self.capacity):
            return False
        pool = self.pools[b.small]
        pool.remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = Blk(b.stream, b.size - mapped, b.ptr + mapped, b.small, seg, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            pool.insert_unmapped(rest)
            b.size = mapped
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert(b)
        self._reserve(mapped)
        self.segment_allocs += 1
        self._event(SEGMENT_MAP, mapped, b.stream, b.ptr)
        return True

    def _try_allocate_expandable(self, pool: Pool, stream: int, size: int, force: bool) -> Blk | None:
        c = self._find_expandable(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), force):
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None
            if not self._map_block(nxt, min(size - c.size, nxt.size), force):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _unmap_block(self, b: Blk) -> None:
        seg = b.seg
        assert seg is not None
        begin = -(-(b.ptr - seg.base) // seg.page)
        end = (b.ptr + b.size - seg.base) // seg.page
        if begin >= end:
            return
        pool = self.pools[b.small]
        pool.remove(b)
        start, size = seg.base + begin * seg.page, (end - begin) * seg.page
        before = start - b.ptr
        if before > 0:
            f = Blk(b.stream, before, b.ptr, b.small, seg)
            f.prev, f.next = b.prev, b
            if b.prev is not None:
                b.prev.next = f
            b.prev = f
            pool.insert(f)
        after = b.size - before - size
        if after > 0:
            f = Blk(b.stream, after, start + size, b.small, seg)
            f.prev, f.next = b, b.next
            if b.next is not None:
                b.next.prev = f
            b.next = f
            pool.insert(f)
        b.ptr, b.size, b.mapped = start, size, False
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self.reserved -= size
        self.segment_frees += 1
        self._event(SEGMENT_UNMAP, size, b.stream, start)

    # ---------------------------------------------------------------------------------------------
    # figures

    def largest_free_block(self) -> int:
        """The biggest cached (mapped, free) block: the largest request served without cudaMalloc."""
        return max((k[1] for p in self.pools.values() for k in p.keys), default=0)


def pending_queue(addresses: list[tuple[int, int]]) -> dict[int, deque[int]]:
    """Hints for Simulator: (size, address) pairs in order -> size -> addresses."""
    out: dict[int, deque[int]] = {}
    for size, addr in addresses:
        out.setdefault(size, deque()).append(addr)
    return out
