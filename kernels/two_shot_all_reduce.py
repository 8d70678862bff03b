"""Two-shot all-reduce (reduce-scatter, then all-gather) through symmetric memory, fused.

Unfused torch equivalent:
    x = prologue(x); dist.all_reduce(x)          # every op rounds to x.dtype
    out = epilogue(x)                              # chain, then optional (add_)rms_norm

The tensor is cut into items (rows when a norm follows, else chunks) and every item into W
sub-shards; rank q owns sub-shard q of every item. Phase 1: each rank pushes sub-shard q of its
(prologue-applied) input into staging slot `rank` of rank q. Barrier. Phase 2: rank q sums its
staging slots in rank order 0..W-1 in fp32 (the same order on every rank, hence identical bits),
rounds to the dtype like the all_reduce output, and pushes the result into every rank's gathered
copy. Barrier. Phase 3: each rank runs the epilogue over whole items of its gathered copy, so a
row norm sees the whole row in one program. Remote traffic is stores only.

No exit barrier is needed: a rank writes a peer's staging only in a later launch, after the
second barrier of this one (so the peer has read its staging), and writes a peer's gathered copy
only after the first barrier of a launch, which the peer reaches only once it has finished the
previous launch, phase 3 included.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_chain import apply_chain, chain_arguments, finish_item, launch_layout
from infini_dist.kernels.symm_signal import (SPIN_TIMEOUT_NS, block_barrier, peer_pointer,
                                             world_size_pow2)


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def two_shot_all_reduce_kernel(
        x_ptr, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
        data_table, signal_table,
        numel, rank, timeout_ns,
        p_scalar0, p_side0, p_scalar1, p_side1, p_scalar2, p_side2,
        e_scalar0, e_side0, e_scalar1, e_side1, e_scalar2, e_side2,
        P_OP0: tl.constexpr, P_OP1: tl.constexpr, P_OP2: tl.constexpr,
        E_OP0: tl.constexpr, E_OP1: tl.constexpr, E_OP2: tl.constexpr,
        NORM: tl.constexpr, WRITE_PRE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first_item = pid.to(tl.int64)  # int64 loop: offsets of big tensors overflow int32
    items = tl.cdiv(numel, ITEM)
    dtype = x_ptr.dtype.element_ty
    sub = tl.arange(0, SUB_BLOCK)
    # Data area: W staging slots of items * SUB elements, then the gathered copy (like x).
    stage_stride = items.to(tl.int64) * SUB
    gathered = WORLD_SIZE * stage_stride

    # Phase 1 moves a whole item as a [owner, sub-shard] tile: all its loads are in flight
    # together, and row q of the tile is stored straight into owner q's staging slot.
    owners = tl.arange(0, WS_P2)
    owner_ok = owners < WORLD_SIZE
    staging_of = tl.load(data_table + owners, mask=owner_ok, other=0)
    staging_of = tl.multiple_of(staging_of.to(tl.pointer_type(dtype)), 16) + rank * stage_stride
    tile = owners[:, None] * SUB + sub[None, :]
    tile_ok = owner_ok[:, None] & (sub < SUB)[None, :] & (tile < ITEM)
    for item in range(first_item, items, programs):
        index = item * ITEM + tile
        mask = tile_ok & (index < numel)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_chain(x, index, mask, P_OP0, p_scalar0, p_side0, P_OP1, p_scalar1, p_side1,
                        P_OP2, p_scalar2, p_side2, dtype)
        tl.store(staging_of[:, None] + (item * SUB + sub)[None, :], x.to(dtype), mask=mask)

    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    local = peer_pointer(data_table, rank, dtype)
    for item in range(first_item, items, programs):
        owned = rank * SUB + sub
        index = item * ITEM + owned
        mask = (sub < SUB) & (owned < ITEM) & (index < numel)
        total = tl.zeros([SUB_BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(local + source * stage_stride + item * SUB + sub, mask=mask,
                             other=0.0).to(tl.float32)
        reduced = total.to(dtype)
        for step in tl.static_range(WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE
            tl.store(peer_pointer(data_table, peer, dtype) + gathered + index, reduced, mask=mask)

    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    column = tl.arange(0, BLOCK)
    for item in range(first_item, items, programs):
        index = item * ITEM + column
        mask = (column < ITEM) & (index < numel)
        y = tl.load(local + gathered + index, mask=mask, other=0.0).to(tl.float32)
        finish_item(y, index, column, mask, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
                    E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1, E_OP2, e_scalar2,
                    e_side2, NORM, WRITE_PRE, ITEM)


def two_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                   norm: int = 0) -> int:
    """Data bytes one call needs: the staging slots plus the gathered copy."""
    layout = launch_layout(numel, row_len, norm, world_size)
    items = triton.cdiv(numel, layout.item)
    return (world_size * items * layout.sub + triton.cdiv(numel, 64) * 64) * element_size


def two_shot_all_reduce(x, buffer, out, *, prologue=(), epilogue=(), sides=None, norm=0,
                        weight=None, residual=None, eps=1e-6, pre=None, row_len=None):
    """Launch on `buffer` (symm_buffers.SymmBuffer); arguments as in one_shot_all_reduce."""
    layout = launch_layout(x.numel(), row_len, norm, buffer.world_size)
    two_shot_all_reduce_kernel[(layout.grid,)](
        x, out, x if pre is None else pre, x if weight is None else weight,
        x if residual is None else residual, float(eps),
        buffer.data_table, buffer.signal_table, x.numel(), buffer.rank, SPIN_TIMEOUT_NS,
        **chain_arguments(prologue, sides, x, "P"), **chain_arguments(epilogue, sides, x, "E"),
        NORM=norm, WRITE_PRE=pre is not None, ITEM=layout.item, BLOCK=layout.block,
        SUB=layout.sub, SUB_BLOCK=layout.sub_block, WORLD_SIZE=buffer.world_size,
        WS_P2=world_size_pow2(buffer.world_size), ON_GPU=x.is_cuda, num_warps=layout.num_warps)

