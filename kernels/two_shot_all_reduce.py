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
row norm sees the whole row in one program. Remote traffic is stores only. Large tensors go in
rounds, phase 3 of one round running alongside phase 2 of the next.

No exit barrier is needed: every item has its own staging and gathered places, so within a launch
nothing is written twice; a rank writes a peer's staging only in a later launch, after the last
barrier of this one (so the peer has read its staging), and writes a peer's gathered copy only
after a barrier of that later launch, which the peer reaches only once it has finished the
previous launch, phase 3 included.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.symm_chain import (apply_chain, finish_item, fused_arguments,
                                            launch_layout)
from infini_dist.kernels.symm_signal import (SPIN_TIMEOUT_NS, block_barrier, empty_like,
                                             never_empty, peer_pointer, poll)


@triton.jit
def item_group(start, last, programs, GROUP: tl.constexpr):
    """Items start, start + programs, ... (GROUP of them), and which of them are < last."""
    items = start + tl.arange(0, GROUP).to(tl.int64) * programs
    return items, items < last


@triton.jit
def staging_targets(data_table, offset, rank, stage_stride, dtype: tl.constexpr,
                    ITEM: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
                    WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr):
    """Where phase 1 sends an item: owner q's staging slot `rank` (at element `offset` of its
    data), and the [owner, sub-shard] tile of item offsets that goes there, with its mask."""
    owners = tl.arange(0, WS_P2)
    owner_ok = owners < WORLD_SIZE
    sub = tl.arange(0, SUB_BLOCK)
    staging_of = tl.load(data_table + owners, mask=owner_ok, other=0)
    staging_of = tl.multiple_of(staging_of.to(tl.pointer_type(dtype)), 16) + offset
    staging_of += rank * stage_stride
    tile = owners[:, None] * SUB + sub[None, :]
    tile_ok = owner_ok[:, None] & (sub < SUB)[None, :] & (tile < ITEM)
    return staging_of, tile, tile_ok


@triton.jit
def scatter_items(x_ptr, staging_of, tile, tile_ok, first, last, programs, numel,
                  P_OP0: tl.constexpr, p_scalar0, p_side0, P_OP1: tl.constexpr, p_scalar1,
                  p_side1, P_OP2: tl.constexpr, p_scalar2, p_side2,
                  ITEM: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
                  GROUP: tl.constexpr):
    """Phase 1 for items first, first + programs, ... < last: GROUP items at a time move as a
    [item, owner, sub-shard] tile (all their loads in flight together), row q to owner q."""
    dtype = x_ptr.dtype.element_ty
    sub = tl.arange(0, SUB_BLOCK)
    for start in range(first, last, programs * GROUP):
        items, valid = item_group(start, last, programs, GROUP)
        index = items[:, None, None] * ITEM + tile[None, :, :]
        mask = valid[:, None, None] & tile_ok[None, :, :] & (index < numel)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_chain(x, index, mask, P_OP0, p_scalar0, p_side0, P_OP1, p_scalar1, p_side1,
                        P_OP2, p_scalar2, p_side2, dtype)
        places = staging_of[None, :, None] + (items[:, None] * SUB + sub[None, :])[:, None, :]
        tl.store(places, x.to(dtype), mask=mask)


@triton.jit
def reduce_items(data_table, staging, stage_stride, gathered, rank, first, last, programs,
                 numel, dtype: tl.constexpr, ITEM: tl.constexpr, SUB: tl.constexpr,
                 SUB_BLOCK: tl.constexpr, WORLD_SIZE: tl.constexpr, GROUP: tl.constexpr,
                 LAMPORT: tl.constexpr):
    """Phase 2: sum this rank's sub-shard over its staging slots (at `staging`) in rank order,
    push it to every rank's gathered copy (at offset `gathered`); GROUP items at a time.
    LAMPORT: the gathered copy is polled (symm_signal), so never store the empty pattern."""
    sub = tl.arange(0, SUB_BLOCK)
    owned = rank * SUB + sub
    for start in range(first, last, programs * GROUP):
        items, valid = item_group(start, last, programs, GROUP)
        index = items[:, None] * ITEM + owned[None, :]
        mask = valid[:, None] & ((sub < SUB) & (owned < ITEM))[None, :] & (index < numel)
        places = staging + items[:, None] * SUB + sub[None, :]
        total = tl.zeros([GROUP, SUB_BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(places + source * stage_stride, mask=mask, other=0.0).to(tl.float32)
        reduced = total.to(dtype)
        if LAMPORT:
            reduced = never_empty(reduced)
        for step in tl.static_range(WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
            tl.store(peer_pointer(data_table, peer, dtype) + gathered + index, reduced, mask=mask)


@triton.jit
def finish_items(local, gathered, first, last, programs, numel, out_ptr, pre_ptr, weight_ptr,
                 residual_ptr, eps, E_OP0: tl.constexpr, e_scalar0, e_side0,
                 E_OP1: tl.constexpr, e_scalar1, e_side1, E_OP2: tl.constexpr, e_scalar2,
                 e_side2, NORM: tl.constexpr, WRITE_PRE: tl.constexpr, ITEM: tl.constexpr,
                 BLOCK: tl.constexpr, GROUP: tl.constexpr, LAMPORT: tl.constexpr, timeout_ns,
                 rank, ON_GPU: tl.constexpr):
    """Phase 3: the epilogue over whole items of the local gathered copy, GROUP at a time.
    LAMPORT: wait for the items by polling them, and empty them after reading."""
    column = tl.arange(0, BLOCK)[None, :]
    for start in range(first, last, programs * GROUP):
        items, valid = item_group(start, last, programs, GROUP)
        index = items[:, None] * ITEM + column
        mask = valid[:, None] & (column < ITEM) & (index < numel)
        if LAMPORT:
            y = poll(local + gathered + index, mask, timeout_ns, rank, ON_GPU)
            tl.store(local + gathered + index, empty_like(y), mask=mask)
            y = y.to(tl.float32)
        else:
            y = tl.load(local + gathered + index, mask=mask, other=0.0).to(tl.float32)
        finish_item(y, index, column, mask, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
                    E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1, E_OP2, e_scalar2,
                    e_side2, NORM, WRITE_PRE, ITEM)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "round_items"])
def two_shot_all_reduce_kernel(
        x_ptr, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
        data_table, signal_table,
        numel, rank, timeout_ns, round_items,
        p_scalar0, p_side0, p_scalar1, p_side1, p_scalar2, p_side2,
        e_scalar0, e_side0, e_scalar1, e_side1, e_scalar2, e_side2,
        P_OP0: tl.constexpr, P_OP1: tl.constexpr, P_OP2: tl.constexpr,
        E_OP0: tl.constexpr, E_OP1: tl.constexpr, E_OP2: tl.constexpr,
        NORM: tl.constexpr, WRITE_PRE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
        GROUP: tl.constexpr, WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr,
        ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first_item = pid.to(tl.int64)  # int64 loops: offsets of big tensors overflow int32
    items = tl.cdiv(numel, ITEM).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    # Data area: W staging slots of items * SUB elements, then the gathered copy (like x).
    stage_stride = items * SUB
    gathered = WORLD_SIZE * stage_stride
    local = peer_pointer(data_table, rank, dtype)
    staging_of, tile, tile_ok = staging_targets(data_table, 0, rank, stage_stride, dtype, ITEM,
                                                SUB, SUB_BLOCK, WORLD_SIZE, WS_P2)

    # Items go in rounds of `round_items` per program. Phase 3 of a round runs after phase 2 of
    # the next, so its local traffic overlaps that round's remote stores.
    round_stride = programs * round_items
    previous_first = first_item
    previous_last = first_item  # no previous round yet
    for first in range(first_item, items, round_stride):
        last = tl.minimum(first + round_stride, items)
        scatter_items(x_ptr, staging_of, tile, tile_ok, first, last, programs, numel,
                      P_OP0, p_scalar0, p_side0, P_OP1, p_scalar1, p_side1, P_OP2, p_scalar2,
                      p_side2, ITEM, SUB, SUB_BLOCK, GROUP)
        block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
        reduce_items(data_table, local, stage_stride, gathered, rank, first, last, programs,
                     numel, dtype, ITEM, SUB, SUB_BLOCK, WORLD_SIZE, GROUP, False)
        finish_items(local, gathered, previous_first, previous_last, programs, numel, out_ptr,
                     pre_ptr, weight_ptr, residual_ptr, eps, E_OP0, e_scalar0, e_side0, E_OP1,
                     e_scalar1, e_side1, E_OP2, e_scalar2, e_side2, NORM, WRITE_PRE, ITEM, BLOCK,
                     GROUP, False, timeout_ns, rank, ON_GPU)
        block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
        previous_first = first
        previous_last = last
    finish_items(local, gathered, previous_first, previous_last, programs, numel, out_ptr,
                 pre_ptr, weight_ptr, residual_ptr, eps, E_OP0, e_scalar0, e_side0, E_OP1,
                 e_scalar1, e_side1, E_OP2, e_scalar2, e_side2, NORM, WRITE_PRE, ITEM, BLOCK,
                 GROUP, False, timeout_ns, rank, ON_GPU)


def two_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                   norm: int = 0) -> int:
    """Data bytes one call needs: the staging slots plus the gathered copy."""
    layout = launch_layout(numel, row_len, norm, world_size)
    items = triton.cdiv(numel, layout.item)
    return (world_size * items * layout.sub + slot_elements(numel)) * element_size


def round_items(items: int, grid: int) -> int:
    """Items per program per round: 16 once a program has 32 or more (overlapping phase 3 with
    the next round's transfers took 392 -> 377 us at 8192 x 4096 bf16 on 4 H200s; see
    docs/notes_symm.md), else one round. INFINI_DIST_SYMM_ROUND_ITEMS=n > 0 forces n; it must
    be the same on every rank, like everything that shapes a launch."""
    override = int(os.environ.get("INFINI_DIST_SYMM_ROUND_ITEMS", "0"))
    per_program = triton.cdiv(items, grid)
    if override > 0:
        return override
    return 16 if per_program >= 32 else max(1, per_program)


def group_items(items: int, grid: int) -> int:
    """Items a program moves at once in each phase: more bytes in flight per program. One item
    (8 KiB of bf16 at hidden 4096) leaves the copy latency-bound; on 4 H200s, add_rms_norm
    x 4096 bf16 went 56.6 -> 54.0 us at 1024 tokens with 2, 364.5 -> 331.1 us at 8192 with 4
    (8 at 8192 was slower again: 377 us, registers). INFINI_DIST_SYMM_GROUP_ITEMS=n > 0 forces n
    (a power of two), the same on every rank."""
    override = int(os.environ.get("INFINI_DIST_SYMM_GROUP_ITEMS", "0"))
    if override > 0:
        return triton.next_power_of_2(override)
    per_program = triton.cdiv(items, grid)
    return 4 if per_program >= 16 else 2 if per_program >= 4 else 1


def two_shot_launch(x, buffer, out, **options):
    """The launch, as (kernel, grid, args, kwargs) with the launch options in kwargs; options
    as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, **options)
    items = triton.cdiv(x.numel(), layout.item)
    args = head + (buffer.data_table, buffer.signal_table, x.numel(), buffer.rank,
                   SPIN_TIMEOUT_NS, round_items(items, layout.grid))
    kwargs.update(SUB=layout.sub, SUB_BLOCK=layout.sub_block,
                  GROUP=group_items(items, layout.grid))
    return two_shot_all_reduce_kernel, (layout.grid,), args, kwargs
