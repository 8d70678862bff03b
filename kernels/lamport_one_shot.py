"""One-shot all-reduce through symmetric memory with Lamport signalling (no barrier), fused.

Unfused torch equivalent:
    x = prologue(x); dist.all_reduce(x)          # every op rounds to x.dtype
    out = epilogue(x)                              # chain, then optional (add_)rms_norm

Like the one-shot kernel, every rank pushes its (prologue-applied) input into slot `rank` of every
peer's buffer and sums its own W slots in fp32. The difference is the signal: the data is its own
flag (symm_signal, "Lamport signalling"), so a program waits only for the places it reads, and the
call costs no release fence, no flag round trip and no acquire. The reader empties its slots after
reading them. The buffer has two halves at fixed offsets, used on alternate calls: a rank can be at
most one call ahead of a peer (call n+1 needs every peer's call-n+1 data, which a peer sends only
after its call n), so the half written by call n+2 has been read and emptied by call n.

The slots are summed in one fixed reduction over the [W, row] tile: every rank runs the same
compiled code on the same values, so all ranks get bitwise identical results.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_chain import (MAX_PROGRAMS, apply_chain, finish_item,
                                            fused_arguments, round_to)
from infini_dist.kernels.symm_signal import (SPIN_TIMEOUT_NS, empty_like, never_empty,
                                             peer_pointer, poll)


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def lamport_one_shot_kernel(
        x_ptr, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
        data_table, epoch_ptr,
        numel, slot_stride, half_stride, rank, timeout_ns,
        p_scalar0, p_side0, p_scalar1, p_side1, p_scalar2, p_side2,
        e_scalar0, e_side0, e_scalar1, e_side1, e_scalar2, e_side2,
        P_OP0: tl.constexpr, P_OP1: tl.constexpr, P_OP2: tl.constexpr,
        E_OP0: tl.constexpr, E_OP1: tl.constexpr, E_OP2: tl.constexpr,
        NORM: tl.constexpr, WRITE_PRE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first_item = pid.to(tl.int64)  # int64 loop: offsets of big tensors overflow int32
    items = tl.cdiv(numel, ITEM)
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    calls = tl.load(epoch_ptr + pid)
    half = (calls % 2).to(tl.int64) * half_stride
    mine = half + rank * slot_stride

    for item in range(first_item, items, programs):
        index = item * ITEM + column
        mask = (column < ITEM) & (index < numel)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_chain(x, index, mask, P_OP0, p_scalar0, p_side0, P_OP1, p_scalar1, p_side1,
                        P_OP2, p_scalar2, p_side2, dtype)
        x = never_empty(x.to(dtype))
        for step in tl.static_range(WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
            tl.store(peer_pointer(data_table, peer, dtype) + mine + index, x, mask=mask)

    local = peer_pointer(data_table, rank, dtype) + half
    sources = tl.arange(0, WS_P2)
    for item in range(first_item, items, programs):
        index = item * ITEM + column
        mask = (column < ITEM) & (index < numel)
        places = local + (sources * slot_stride)[:, None] + index[None, :]
        present = (sources < WORLD_SIZE)[:, None] & mask[None, :]
        values = poll(places, present, timeout_ns, rank, ON_GPU)
        tl.store(places, empty_like(values), mask=present)
        total = tl.sum(values.to(tl.float32), axis=0)
        finish_item(round_to(total, dtype), index, column, mask, out_ptr, pre_ptr, weight_ptr,
                    residual_ptr, eps, E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1,
                    E_OP2, e_scalar2, e_side2, NORM, WRITE_PRE, ITEM)

    # Every slot s counts this call (see one_shot_all_reduce: later launches may use other grids).
    slots = tl.arange(0, MAX_PROGRAMS)
    tl.store(epoch_ptr + slots, calls + 1, mask=(slots % programs) == pid)


def lamport_one_shot_launch(x, buffer, out, **options):
    """The launch, as (kernel, grid, args, kwargs); options as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, **options)
    args = head + (buffer.data_table, buffer.epoch, x.numel(), slot_elements(x.numel()),
                   part_elements(buffer, x.element_size(), 2), buffer.rank, SPIN_TIMEOUT_NS)
    # The poll holds a [W, row] tile: past 4 ranks, twice the warps keep it near 64 elements a
    # thread (for rows up to 8192).
    if buffer.world_size > 4:
        kwargs["num_warps"] = min(16, 2 * layout.num_warps)
    kwargs["MAX_PROGRAMS"] = MAX_PROGRAMS
    return lamport_one_shot_kernel, (layout.grid,), args, kwargs
