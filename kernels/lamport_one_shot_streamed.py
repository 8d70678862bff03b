"""One-shot all-reduce with Lamport signalling, streamed: each program pushes its next group of
items while it reduces the current one, so the link and HBM work at once. Fused.

Unfused torch equivalent:
    x = prologue(x); dist.all_reduce(x)          # every op rounds to x.dtype
    out = epilogue(x)                              # chain, then optional (add_)rms_norm

The protocol is lamport_one_shot's (every rank pushes its prologue-applied items into slot
`rank` of every peer, readers poll and empty what they read, two halves used on alternate
calls), with two differences that matter once the tensor is large:
- A program alternates: push group g + 1, then poll, sum and finish group g. The pushes of g + 1
  are in flight while group g's HBM work (the poll, the residual, the stores) runs, where
  lamport_one_shot pushes every item before it reduces any.
- A rank's own contribution stays in registers from its push to its sum: nothing goes through
  its own slot. At 2 ranks that is 7 tensor-sized HBM passes a call (read x, the peer's
  incoming write, the poll's read, the emptying, the residual, out, the new residual), where a
  two-shot with the same epilogue makes 7.5 and also needs a second link phase behind the first.

The link moves (W - 1) x the tensor out of every rank, against a two-shot's 2 (W - 1) / W: the
same at 2 ranks, more above; the engine times both. The sum is one reduction over the [W, item]
tile with the own row put in at its rank's place, so every rank adds the same values in the
same order and gets the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.one_shot_all_reduce import one_shot_bytes
from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_call import SymmKernel
from infini_dist.kernels.symm_chain import MAX_PROGRAMS, fused_arguments, round_to
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, advance_epoch, apply_prologue,
                                             call_half, finish_loaded, group_items, item_group,
                                             pdl_options, program_items, take_with_operands,
                                             wait_for_predecessor)
from infini_dist.kernels.symm_signal import never_empty, peer_pointer


@triton.jit
def _group_places(start, last, programs, numel, ITEM: tl.constexpr, BLOCK: tl.constexpr,
                  GROUP: tl.constexpr):
    """The [GROUP, BLOCK] element offsets of items start, start + programs, ... and which of
    them exist (none once start >= last)."""
    column = tl.arange(0, BLOCK)[None, :]
    items, valid = item_group(start, last, programs, GROUP)
    index = items[:, None] * ITEM + column
    return index, column, valid[:, None] & (column < ITEM) & (index < numel)


@triton.jit
def _push_group(x_ptr, data_table, rank, offset, start, last, programs, numel, chain,
                OPS: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr,
                GROUP: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """A group's items, prologue applied, rounded and never the empty pattern, stored at
    element `offset` of every other rank's data; returned, as this rank's own contribution."""
    dtype = x_ptr.dtype.element_ty
    index, column, mask = _group_places(start, last, programs, numel, ITEM, BLOCK, GROUP)
    x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
    x = never_empty(apply_prologue(x, index, mask, chain, OPS, dtype).to(dtype))
    for step in tl.static_range(1, WORLD_SIZE):
        peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
        tl.store(peer_pointer(data_table, peer, dtype) + offset + index, x, mask=mask)
    return x


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def lamport_one_shot_streamed_kernel(
        x_ptr, prologue, epilogue, data_table, epoch_ptr, numel, slot_stride, half_stride, rank,
        timeout_ns, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ITEM: tl.constexpr,
        BLOCK: tl.constexpr, GROUP: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr,
        PRELOAD: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    calls, half = call_half(epoch_ptr, pid, half_stride)
    dtype = x_ptr.dtype.element_ty
    local = peer_pointer(data_table, rank, dtype) + half
    mine_at = half + rank * slot_stride
    sources = tl.arange(0, WS_P2)[:, None, None]
    step = programs * GROUP

    mine = _push_group(x_ptr, data_table, rank, mine_at, first_item, items, programs, numel,
                       prologue, PROLOGUE, ITEM, BLOCK, GROUP, WORLD_SIZE)
    for start in range(first_item, items, step):
        # The next group's pushes go out before this group's wait (past the end: all masked).
        following = _push_group(x_ptr, data_table, rank, mine_at, start + step, items, programs,
                                numel, prologue, PROLOGUE, ITEM, BLOCK, GROUP, WORLD_SIZE)
        index, column, mask = _group_places(start, items, programs, numel, ITEM, BLOCK, GROUP)
        places = local + sources * slot_stride + index[None, :, :]
        present = (sources < WORLD_SIZE) & (sources != rank) & mask[None, :, :]
        values, operands = take_with_operands(places, present, timeout_ns, rank, ON_GPU, index,
                                              column, mask, epilogue, EPILOGUE, PRELOAD)
        values = tl.where(sources == rank, mine[None, :, :], values)
        total = tl.sum(values.to(tl.float32), axis=0)
        finish_loaded(round_to(total, dtype), operands, index, column, mask, epilogue, EPILOGUE,
                      ITEM)
        mine = following

    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


def lamport_one_shot_streamed_launch(x, buffer, out, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs); options as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    # Items a step, measured on 2 H100s with add_rms_norm x 4096 bf16 (docs/notes_symm.md,
    # sessions 17-18): two rows a step once a program has 64 rows (8192 tokens: 1-4% faster,
    # with or without FP8); one below (two were 4-14% slower at 1024 and 2048). Session 17
    # took two from 32 rows with a per-token quantizer, whose second row reduction the two
    # shared; that reduction is now folded into the norm's (fold_row_max), and two rows were 4%
    # slower at 4096 with it. Not past 4 ranks: the polled [W, 2, row] tile would double what a
    # thread holds (at 3-4 ranks the sm_90 code spills 5-22 registers; not timed, and the
    # two-shot's spills at 4 rows a step cost less than 2 rows: session 27). (On 2 H200s,
    # before the operands' preload, one a step was the faster at 8192: session 11.) Twice the
    # layout's warps: 8 and 16 measured the same there, 4 was 45% slower; at 1-128 tokens 4
    # and 8 were within 2% of 16, 5-8% slower with per-token FP8.
    items = triton.cdiv(x.numel(), layout.item)
    if tuning.group_items:
        group = group_items(items, layout.grid, tuning)
    elif buffer.world_size <= 4 and options.get("norm") and items >= 64 * layout.grid:
        group = 2
    else:
        group = 1
    args = head + (buffer.data_table, buffer.epoch, x.numel(), slot_elements(x.numel()),
                   part_elements(buffer, x.element_size(), 2), buffer.rank, tuning.timeout_ns)
    kwargs.update(GROUP=group, MAX_PROGRAMS=MAX_PROGRAMS, PRELOAD=tuning.preload,
                  num_warps=min(16, 2 * layout.num_warps * group))
    kwargs.update(pdl_options(tuning, x))
    return lamport_one_shot_streamed_kernel, (layout.grid,), args, kwargs


# The plain callable (torch's equivalent in SymmKernel.__call__); lamport_one_shot's two halves
# of W slots (the own slot stays unused).
lamport_one_shot_streamed_all_reduce = SymmKernel(
    "one_shot_lamport_streamed", lamport_one_shot_streamed_launch, one_shot_bytes, lamport=True)
