"""An independent model of what PyTorch's own CUDA caching allocator answers (issue 18, item 2).

Written from PyTorch's source, not from memshim's: every rule below names the file and function it
comes from (c10/cuda/CUDACachingAllocator.cpp as stored in the source index, commit 001074d2;
torch/csrc/cuda/Module.cpp, THCPModule_memoryStats; torch/cuda/memory.py of the installed 2.15
wheel). It models the native allocator without expandable segments, without max_split_size and
without roundup_power2_divisions (PyTorch's defaults), one device. memshim answers in PyTorch's
name through memshim_torch_stats(); tests/differential/test_differential.py holds those answers
against this model, key by key, with memshim's documented deviations (docs/pytorch.md, "The memory
API in tensor mode") named where they apply. Nothing here imports memshim."""

# CUDACachingAllocator.cpp, the constants at the top of namespace Native
kMinBlockSize = 512          # "all sizes are rounded to at least 512 bytes"
kSmallSize = 1048576         # "largest 'small' allocation is 1 MiB"
kSmallBuffer = 2097152       # "'small' allocations are packed in 2 MiB blocks"
kLargeBuffer = 20971520      # "'large' allocations may be packed in 20 MiB blocks"
kMinLargeAlloc = 10485760    # "allocations between 1 and 10 MiB may use kLargeBuffer"
kRoundLarge = 2097152        # "round up large allocations to 2 MiB"

# Module.cpp, THCPModule_memoryStats: the stat arrays, each {all, small_pool, large_pool} x
# {current, peak, allocated, freed}; the two single stats; the scalars. memory.py's memory_stats()
# flattens the nested dict with '.' (_recurse_add_to_result) and sorts the keys.
STAT_ARRAYS = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
               "active_bytes", "inactive_split_bytes", "requested_bytes"]
STAT_TYPES = ["all", "small_pool", "large_pool"]
STAT_FIELDS = ["current", "peak", "allocated", "freed"]
SINGLE_STATS = ["oversize_allocations", "oversize_segments"]
SCALARS = ["num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams", "num_device_alloc",
           "num_device_free"]


def memory_stats_keys():
    keys = [f"{a}.{t}.{f}" for a in STAT_ARRAYS for t in STAT_TYPES for f in STAT_FIELDS]
    keys += [f"{s}.{f}" for s in SINGLE_STATS for f in STAT_FIELDS]
    return sorted(keys + SCALARS)


def round_size(size):
    """DeviceCachingAllocator::round_size (roundup_power2_divisions unset)."""
    if size < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


def is_small(rounded):
    """DeviceCachingAllocator::get_pool: `size <= kSmallSize` on the rounded size."""
    return rounded <= kSmallSize


def get_allocation_size(size):
    """DeviceCachingAllocator::get_allocation_size: the segment cudaMalloc'd for a request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


def should_split(pool_small, block_size, size):
    """DeviceCachingAllocator::should_split (max_split_size unset: SIZE_MAX)."""
    remaining = block_size - size
    if pool_small:
        return remaining >= kMinBlockSize
    return remaining > kSmallSize


class Stat:
    """increase_stat / decrease_stat / reset_peak_stat / reset_accumulated_stat."""

    def __init__(self):
        self.current = self.peak = self.allocated = self.freed = 0

    def inc(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)
        self.allocated += n

    def dec(self, n):
        self.current -= n
        self.freed += n


class Block:
    def __init__(self, seg, ptr, size):
        self.seg, self.ptr, self.size, self.requested = seg, ptr, size, 0
        self.allocated = False


class Segment:
    def __init__(self, ptr, size, small):
        self.ptr, self.size, self.small = ptr, size, small
        self.blocks = []  # in address order


class CachingAllocator:
    """One DeviceCachingAllocator, one stream, no captures. `capacity`: what cudaMalloc can give
    (the device's memory); `fraction`: set_per_process_memory_fraction (None: never set)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.stats = {a: {t: Stat() for t in STAT_TYPES} for a in STAT_ARRAYS}
        self.single = {s: Stat() for s in SINGLE_STATS}
        self.num_ooms = self.num_alloc_retries = self.num_device_alloc = self.num_device_free = 0
        self.num_sync_all_streams = 0
        self.segments = []
        self.next_ptr = 1 << 40
        self.total_allocated_memory = 0   # bytes cudaMalloc'd (reserved)
        self.set_fraction = False
        self.allowed_memory_maximum = 0
        self.live = {}  # ptr -> Block

    # -- DeviceCachingAllocator::setMemoryFraction: allowed = fraction * device_total
    def set_memory_fraction(self, fraction):
        # NativeCachingAllocator::setMemoryFraction asserts 0 <= fraction <= 1 (memory.py raises
        # ValueError outside 0~1 first); 0 is allowed and means no new segment fits.
        assert 0 <= fraction <= 1
        self.allowed_memory_maximum = int(fraction * self.capacity)
        self.set_fraction = True

    def get_memory_fraction(self):
        """What get_per_process_memory_fraction answers: 1.0 until a fraction is set."""
        return self.allowed_memory_maximum / self.capacity if self.set_fraction else 1.0

    def _bump(self, names, small, n, inc=True):
        for a in names:
            for t in ("all", "small_pool" if small else "large_pool"):
                (self.stats[a][t].inc if inc else self.stats[a][t].dec)(n)

    # -- DeviceCachingAllocator::get_free_block: best fit (smallest size, then lowest address)
    def _free_block(self, small, size):
        best = None
        for s in self.segments:
            if s.small != small:
                continue
            for b in s.blocks:
                if not b.allocated and b.size >= size and (best is None or (b.size, b.ptr) < (best.size, best.ptr)):
                    best = b
        return best

    # -- alloc_block: cudaMalloc of get_allocation_size, refused past the fraction's allowance
    def _alloc_segment(self, small, alloc_size):
        if self.set_fraction and self.total_allocated_memory + alloc_size > self.allowed_memory_maximum:
            return None
        if self.total_allocated_memory + alloc_size > self.capacity:
            return None
        seg = Segment(self.next_ptr, alloc_size, small)
        self.next_ptr += alloc_size + (1 << 30)
        seg.blocks.append(Block(seg, seg.ptr, alloc_size))
        self.segments.append(seg)
        self.total_allocated_memory += alloc_size
        self._bump(["segment"], small, 1)
        self._bump(["reserved_bytes"], small, alloc_size)
        self.num_device_alloc += 1
        return seg.blocks[0]

    # -- release_cached_blocks -> release_blocks: every free, unsplit segment goes back
    def empty_cache(self):
        for s in list(self.segments):
            if len(s.blocks) == 1 and not s.blocks[0].allocated:
                self.segments.remove(s)
                self.total_allocated_memory -= s.size
                self._bump(["segment"], s.small, 1, inc=False)
                self._bump(["reserved_bytes"], s.small, s.size, inc=False)
                self.num_device_free += 1

    def malloc(self, orig_size):
        """NativeCachingAllocator::allocate: size 0 never reaches malloc (no block, no stats);
        else DeviceCachingAllocator::malloc. Returns a pointer, None for size 0, or raises
        MemoryError (OutOfMemoryError, counted in num_ooms)."""
        if orig_size == 0:
            return None
        size = round_size(orig_size)
        small = is_small(size)
        alloc_size = get_allocation_size(size)
        block = self._free_block(small, size)
        if block is None:
            block = self._alloc_segment(small, alloc_size)
            if block is None:
                # release_cached_blocks, then alloc_block(isRetry=true): num_alloc_retries += 1
                self.empty_cache()
                self.num_alloc_retries += 1
                block = self._alloc_segment(small, alloc_size)
            if block is None:
                self.num_ooms += 1
                raise MemoryError(orig_size)
        # alloc_found_block: split the remainder off when should_split says so
        if should_split(small, block.size, size):
            seg = block.seg
            i = seg.blocks.index(block)
            rest = Block(seg, block.ptr + size, block.size - size)
            block.size = size
            seg.blocks.insert(i + 1, rest)
        block.allocated = True
        block.requested = orig_size
        self._bump(["allocation", "active"], small, 1)
        self._bump(["allocated_bytes", "active_bytes"], small, block.size)
        self._bump(["requested_bytes"], small, orig_size)
        self.live[block.ptr] = block
        return block.ptr

    def free(self, ptr):
        """DeviceCachingAllocator::free (allocation, allocated_bytes) then free_block (active,
        active_bytes, requested_bytes; merge with free neighbours) at once: one stream, no
        recorded streams, so no events are pending."""
        block = self.live.pop(ptr)
        small = block.seg.small
        self._bump(["allocation"], small, 1, inc=False)
        self._bump(["allocated_bytes"], small, block.size, inc=False)
        self._bump(["active"], small, 1, inc=False)
        self._bump(["active_bytes"], small, block.size, inc=False)
        self._bump(["requested_bytes"], small, block.requested, inc=False)
        block.allocated = False
        blocks = block.seg.blocks
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # try_merge_blocks with next, then prev
            if 0 <= j < len(blocks) and not blocks[j].allocated:
                lo, hi = sorted((blocks[j], block), key=lambda b: b.ptr)
                lo.size += hi.size
                blocks.remove(hi)
                block = lo
                i = blocks.index(block)

    def reset_peak(self):
        """resetPeakStats: peak = current for every stat."""
        for a in self.stats.values():
            for s in a.values():
                s.peak = s.current
        for s in self.single.values():
            s.peak = s.current

    def reset_accumulated(self):
        """resetAccumulatedStats: allocated = freed = 0, and the counters."""
        for a in self.stats.values():
            for s in a.values():
                s.allocated = s.freed = 0
        for s in self.single.values():
            s.allocated = s.freed = 0
        self.num_alloc_retries = self.num_ooms = self.num_sync_all_streams = 0
        self.num_device_alloc = self.num_device_free = 0

    def memory_stats(self):
        """The flat dict memory_stats() returns."""
        out = {}
        for a, per in self.stats.items():
            for t, s in per.items():
                for f in STAT_FIELDS:
                    out[f"{a}.{t}.{f}"] = getattr(s, f)
        for n, s in self.single.items():
            for f in STAT_FIELDS:
                out[f"{n}.{f}"] = getattr(s, f)
        out.update(num_alloc_retries=self.num_alloc_retries, num_ooms=self.num_ooms,
                   max_split_size=-1,  # Module.cpp: stats.max_split_size; SIZE_MAX -> -1 as int64
                   num_sync_all_streams=self.num_sync_all_streams, num_device_alloc=self.num_device_alloc,
                   num_device_free=self.num_device_free)
        return out

    def split_remainders(self):
        """Bytes by which live large blocks exceed their rounded request (a remainder of 1 MiB
        or less that should_split did not split off): the one place where PyTorch's
        allocated_bytes counts more than the rounded requests."""
        return sum(b.size - round_size(b.requested) for b in self.live.values())
