"""Device helpers shared by the symmetric-memory kernels: peer pointers and a block barrier.

Every rank's buffer holds one int32 flag per (program slot, source rank). A flag is a counting
semaphore: the source adds 1 with a system-scope release after its stores, the owner waits until
it is non-zero and subtracts 1 with an acquire. Counting (rather than set/clear) makes a barrier
reusable at once: a rank that runs ahead into its next barrier only raises the count, and its
n-th arrival always pairs with the owner's n-th wait, so the flags never need a reset and a
CUDA-graph replay sees the same protocol as an eager call.

Program b on one rank pairs only with program b on its peers, so every rank must launch the
same grid (the host code derives it from shapes alone).
"""

import triton
import triton.language as tl

# The default of a wait's limit (SymmTuning.timeout_s): past it the kernel traps, so a peer that
# never arrives becomes a CUDA error in every process instead of a silent hang. Generous, since a
# peer may be late for host reasons.
DEFAULT_TIMEOUT_S = 300.0


@triton.jit
def peer_pointer(table, peer, dtype: tl.constexpr):
    """The address `table[peer]` as a pointer to `dtype`; the host keeps it 16-byte aligned, which
    lets loads and stores through it be vectorised."""
    address = tl.load(table + peer)
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


# The unused operand `anchor` gives the asm a scalar shape on every Triton version.
@triton.jit
def _globaltimer(anchor):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap(anchor):
    tl.inline_asm_elementwise("trap;", "=r,r", [anchor], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def spin_until_set(flags, mask, timeout_ns, anchor, ON_GPU: tl.constexpr):
    """Loads the int32 `flags` (where `mask`) until none of them is zero; on the GPU, traps
    past `timeout_ns`."""
    seen = tl.load(flags, mask=mask, other=1, volatile=True)
    if ON_GPU:
        started = _globaltimer(anchor)
    while tl.min(seen, 0) == 0:
        if ON_GPU:
            if _globaltimer(anchor) - started > timeout_ns:
                _trap(anchor)
        seen = tl.load(flags, mask=mask, other=1, volatile=True)


@triton.jit
def block_barrier(signal_table, rank, slot, timeout_ns, WORLD_SIZE: tl.constexpr,
                  WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    """Program `slot` of every rank arrives here before any of them goes on. Writes made before
    it (by any thread of the program, to any rank's memory) are visible after it."""
    # All threads' stores are issued before one thread per peer releases them.
    tl.debug_barrier()
    peers = tl.arange(0, WS_P2)
    valid = peers < WORLD_SIZE
    first_flag = slot * WORLD_SIZE
    remote = tl.load(signal_table + peers, mask=valid, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_add(remote + first_flag + rank, 1, mask=valid, sem="release", scope="sys")
    mine = tl.load(signal_table + rank).to(tl.pointer_type(tl.int32)) + first_flag + peers
    spin_until_set(mine, valid, timeout_ns, rank, ON_GPU)
    # Each warp spins on its own copy of the flags; none may still be spinning when they are
    # decremented, or it could read the decremented zero and spin forever.
    tl.debug_barrier()
    # The acquiring decrement reads the releasing increment: peers' writes are now visible.
    tl.atomic_add(mine, -1, mask=valid, sem="acquire", scope="sys")
    tl.debug_barrier()


def world_size_pow2(world_size: int) -> int:
    return max(2, triton.next_power_of_2(world_size))


# ---- Lamport signalling: the data is its own flag ------------------------------------------------
#
# A place in a Lamport buffer is empty when it holds the bits of -0.0 (all ranks agree on that
# pattern per element width). Writers turn -0.0 into +0.0 before they store, so a stored value
# never reads as empty; the reader polls the places it needs until none is empty, uses the values
# it polled, and writes the places back to empty for a later call. No flag, fence or barrier is
# on the path: a 2-byte or 4-byte element is either the old pattern or the new value.


@triton.jit
def is_empty(values):
    if values.dtype.primitive_bitwidth == 16:
        return values.to(tl.uint16, bitcast=True) == 0x8000
    else:
        return values.to(tl.uint32, bitcast=True) == 0x80000000


@triton.jit
def never_empty(values):
    """`values` (already in the stored dtype) with -0.0 replaced by +0.0, by their bits: every
    other value keeps its bits, a NaN's payload included."""
    return tl.where(is_empty(values), tl.zeros_like(values), values)


@triton.jit
def empty_like(values):
    if values.dtype.primitive_bitwidth == 16:
        return tl.full(values.shape, 0x8000, tl.uint16).to(values.dtype, bitcast=True)
    else:
        return tl.full(values.shape, 0x80000000, tl.uint32).to(values.dtype, bitcast=True)


@triton.jit
def poll(places, present, timeout_ns, anchor, ON_GPU: tl.constexpr):
    """Loads `places` (where `present`) until none of them is empty; returns what it loaded.
    The reduction over the whole tile is CTA-wide, so every warp leaves the loop together."""
    values = tl.load(places, mask=present, other=0.0, volatile=True)
    if ON_GPU:
        started = _globaltimer(anchor)
    while tl.max(is_empty(values).to(tl.int32)) > 0:
        if ON_GPU:
            if _globaltimer(anchor) - started > timeout_ns:
                _trap(anchor)
        values = tl.load(places, mask=present, other=0.0, volatile=True)
    return values


@triton.jit
def take(places, present, timeout_ns, anchor, ON_GPU: tl.constexpr):
    """`poll`, then empty the places for a later call: what a Lamport reader does."""
    values = poll(places, present, timeout_ns, anchor, ON_GPU)
    tl.store(places, empty_like(values), mask=present)
    return values
