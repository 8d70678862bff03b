"""Two-shot all-reduce through symmetric memory with Lamport signalling (no barrier), fused.

Unfused torch equivalent:
    x = prologue(x); dist.all_reduce(x)          # every op rounds to x.dtype
    out = epilogue(x)                              # chain, then optional (add_)rms_norm

The same three phases as the two-shot kernel (push sub-shards to their owners; owners reduce and
push the result to every rank's gathered copy; epilogue over whole items), but each phase waits
only for the places it reads, by polling them (symm_signal, "Lamport signalling"), instead of two
block barriers per round. Each item moves on as soon as its own data has arrived, so phases of
different items overlap by themselves. Readers empty what they read. Two halves at fixed offsets
serve alternate calls; a rank is at most one call ahead of any peer (its call n+1 needs the peer's
call-n+1 reduced shard), so the half written by call n+2 has been read and emptied in call n.

Owners sum the W staging slots in one fixed reduction over the [W, sub-shard] tile and every rank
reads the owners' rounded results, so all ranks get bitwise identical outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_chain import (MAX_PROGRAMS, apply_chain, finish_item,
                                            fused_arguments, launch_layout)
from infini_dist.kernels.symm_signal import (SPIN_TIMEOUT_NS, empty_like, never_empty,
                                             peer_pointer, poll)
from infini_dist.kernels.two_shot_all_reduce import staging_targets


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def lamport_two_shot_kernel(
        x_ptr, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
        data_table, epoch_ptr,
        numel, half_stride, rank, timeout_ns,
        p_scalar0, p_side0, p_scalar1, p_side1, p_scalar2, p_side2,
        e_scalar0, e_side0, e_scalar1, e_side1, e_scalar2, e_side2,
        P_OP0: tl.constexpr, P_OP1: tl.constexpr, P_OP2: tl.constexpr,
        E_OP0: tl.constexpr, E_OP1: tl.constexpr, E_OP2: tl.constexpr,
        NORM: tl.constexpr, WRITE_PRE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
        MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr,
        ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first_item = pid.to(tl.int64)  # int64 loops: offsets of big tensors overflow int32
    items = tl.cdiv(numel, ITEM).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    calls = tl.load(epoch_ptr + pid)
    # A half: W staging slots of items * SUB elements, then the gathered copy (like x).
    half = (calls % 2).to(tl.int64) * half_stride
    stage_stride = items * SUB
    gathered = half + WORLD_SIZE * stage_stride
    local = peer_pointer(data_table, rank, dtype)

    ranks = tl.arange(0, WS_P2)
    rank_ok = ranks < WORLD_SIZE
    sub = tl.arange(0, SUB_BLOCK)

    # Phase 1: sub-shard q of each item, as one [owner, sub-shard] tile, to owner q's slot `rank`.
    staging_of, tile, tile_ok = staging_targets(data_table, half, rank, stage_stride, dtype,
                                                ITEM, SUB, SUB_BLOCK, WORLD_SIZE, WS_P2)
    for item in range(first_item, items, programs):
        index = item * ITEM + tile
        mask = tile_ok & (index < numel)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_chain(x, index, mask, P_OP0, p_scalar0, p_side0, P_OP1, p_scalar1, p_side1,
                        P_OP2, p_scalar2, p_side2, dtype)
        tl.store(staging_of[:, None] + (item * SUB + sub)[None, :], never_empty(x.to(dtype)),
                 mask=mask)

    # Phase 2: this rank's sub-shard, summed over the W sources, to every rank's gathered copy.
    owned = rank * SUB + sub
    for item in range(first_item, items, programs):
        index = item * ITEM + owned
        mask = (sub < SUB) & (owned < ITEM) & (index < numel)
        places = local + half + (ranks * stage_stride)[:, None] + (item * SUB + sub)[None, :]
        present = rank_ok[:, None] & mask[None, :]
        values = poll(places, present, timeout_ns, rank, ON_GPU)
        tl.store(places, empty_like(values), mask=present)
        reduced = never_empty(tl.sum(values.to(tl.float32), axis=0).to(dtype))
        for step in tl.static_range(WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
            tl.store(peer_pointer(data_table, peer, dtype) + gathered + index, reduced, mask=mask)

    # Phase 3: the epilogue over whole items of the local gathered copy.
    column = tl.arange(0, BLOCK)
    for item in range(first_item, items, programs):
        index = item * ITEM + column
        mask = (column < ITEM) & (index < numel)
        y = poll(local + gathered + index, mask, timeout_ns, rank, ON_GPU)
        tl.store(local + gathered + index, empty_like(y), mask=mask)
        finish_item(y.to(tl.float32), index, column, mask, out_ptr, pre_ptr, weight_ptr,
                    residual_ptr, eps, E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1,
                    E_OP2, e_scalar2, e_side2, NORM, WRITE_PRE, ITEM)

    # Every slot s counts this call (see one_shot_all_reduce: later launches may use other grids).
    slots = tl.arange(0, MAX_PROGRAMS)
    tl.store(epoch_ptr + slots, calls + 1, mask=(slots % programs) == pid)


def lamport_two_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                           norm: int = 0) -> int:
    """Data bytes one call needs: two halves, each W staging slots plus the gathered copy."""
    layout = launch_layout(numel, row_len, norm, world_size)
    half = world_size * triton.cdiv(numel, layout.item) * layout.sub + numel
    return 2 * slot_elements(half) * element_size


def lamport_two_shot_launch(x, buffer, out, **options):
    """The launch, as (kernel, grid, args, kwargs); options as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, **options)
    args = head + (buffer.data_table, buffer.epoch, x.numel(),
                   part_elements(buffer, x.element_size(), 2), buffer.rank, SPIN_TIMEOUT_NS)
    kwargs.update(SUB=layout.sub, SUB_BLOCK=layout.sub_block, MAX_PROGRAMS=MAX_PROGRAMS,
                  # Half the barrier kernel's warps: 11.8 vs 12.6 us at 128 x 4096 bf16 on 4 H200s.
                  num_warps=max(4, layout.num_warps // 2))
    return lamport_two_shot_kernel, (layout.grid,), args, kwargs
