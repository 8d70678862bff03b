"""One-shot all-reduce through symmetric memory, with a fused prologue and epilogue.

Unfused torch equivalent:
    x = prologue(x); dist.all_reduce(x)          # every op rounds to x.dtype
    out = epilogue(x)                              # chain, then optional (add_)rms_norm

Every rank pushes its (prologue-applied) input into slot `rank` of every peer's buffer, signals,
waits for all peers, then sums the slots of its own buffer in rank order 0..W-1 in fp32: each rank
adds the same numbers in the same order, so all ranks get bitwise identical results. Remote
traffic is stores only, and one barrier per call suffices: the buffer has two halves at fixed
offsets, used on alternate calls (parity of a per-buffer call counter kept on the device), and
the barrier of call n+1 proves that every peer finished call n, so the half written by call n+2 is
free. The halves sit at the same place for every shape: a peer one call ahead writes the other
half even when its call has another shape.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_chain import (MAX_PROGRAMS, apply_chain, finish_item,
                                            fused_arguments, round_to)
from infini_dist.kernels.symm_signal import SPIN_TIMEOUT_NS, block_barrier, peer_pointer


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def one_shot_all_reduce_kernel(
        x_ptr, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
        data_table, signal_table, epoch_ptr,
        numel, slot_stride, half_stride, rank, timeout_ns,
        p_scalar0, p_side0, p_scalar1, p_side1, p_scalar2, p_side2,
        e_scalar0, e_side0, e_scalar1, e_side1, e_scalar2, e_side2,
        P_OP0: tl.constexpr, P_OP1: tl.constexpr, P_OP2: tl.constexpr,
        E_OP0: tl.constexpr, E_OP1: tl.constexpr, E_OP2: tl.constexpr,
        NORM: tl.constexpr, WRITE_PRE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    # An item is a row (NORM) or a BLOCK-long chunk; program p owns items p, p + grid, ...
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
        start = item * ITEM
        index = start + column
        mask = (column < ITEM) & (index < numel)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_chain(x, index, mask, P_OP0, p_scalar0, p_side0, P_OP1, p_scalar1, p_side1,
                        P_OP2, p_scalar2, p_side2, dtype).to(dtype)
        for step in tl.static_range(WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
            tl.store(peer_pointer(data_table, peer, dtype) + mine + index, x, mask=mask)

    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    local = peer_pointer(data_table, rank, dtype) + half
    for item in range(first_item, items, programs):
        start = item * ITEM
        index = start + column
        mask = (column < ITEM) & (index < numel)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(local + source * slot_stride + index, mask=mask,
                             other=0.0).to(tl.float32)
        finish_item(round_to(total, dtype), index, column, mask, out_ptr, pre_ptr, weight_ptr,
                    residual_ptr, eps, E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1,
                    E_OP2, e_scalar2, e_side2, NORM, WRITE_PRE, ITEM)

    # Every slot s (not only those below the grid) counts this call: slot s is advanced by the
    # program s % grid, so a later launch with another grid still reads the right parity.
    slots = tl.arange(0, MAX_PROGRAMS)
    tl.store(epoch_ptr + slots, calls + 1, mask=(slots % programs) == pid)


def one_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                   norm: int = 0) -> int:
    """Data bytes one call needs: two halves of `world_size` slots (rows do not matter)."""
    return 2 * world_size * slot_elements(numel) * element_size


def one_shot_launch(x, buffer, out, **options):
    """The launch, as (kernel, grid, args, kwargs) with the launch options in kwargs; options
    as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, **options)
    args = head + (buffer.data_table, buffer.signal_table, buffer.epoch, x.numel(),
                   slot_elements(x.numel()), part_elements(buffer, x.element_size(), 2),
                   buffer.rank, SPIN_TIMEOUT_NS)
    kwargs["MAX_PROGRAMS"] = MAX_PROGRAMS
    return one_shot_all_reduce_kernel, (layout.grid,), args, kwargs
