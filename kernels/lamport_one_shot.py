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

from infini_dist.kernels.one_shot_all_reduce import one_shot_bytes
from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_call import SymmKernel
from infini_dist.kernels.symm_chain import MAX_PROGRAMS, fused_arguments, round_to
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, advance_epoch, call_half,
                                             finish_loaded, item_range, pdl_options, program_items,
                                             push_items, take_with_operands, wait_for_predecessor)
from infini_dist.kernels.symm_signal import peer_pointer


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def lamport_one_shot_kernel(
        x_ptr, prologue, epilogue, data_table, epoch_ptr, numel, slot_stride, half_stride, rank,
        timeout_ns, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ITEM: tl.constexpr,
        BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr,
        WS_P2: tl.constexpr, ON_GPU: tl.constexpr, PRELOAD: tl.constexpr,
        PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    calls, half = call_half(epoch_ptr, pid, half_stride)

    # Push: this rank's items, prologue applied and never the empty pattern, to every peer.
    push_items(x_ptr, data_table, rank, half + rank * slot_stride, first_item, items, programs,
               numel, prologue, PROLOGUE, ITEM, BLOCK, WORLD_SIZE, True)

    # Reduce: poll the W slots of each item, empty them, sum them as one [W, item] tile.
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    local = peer_pointer(data_table, rank, dtype) + half
    sources = tl.arange(0, WS_P2)
    for item in range(first_item, items, programs):
        index, mask = item_range(item, column, numel, ITEM)
        places = local + (sources * slot_stride)[:, None] + index[None, :]
        present = (sources < WORLD_SIZE)[:, None] & mask[None, :]
        values, operands = take_with_operands(places, present, timeout_ns, rank, ON_GPU, index,
                                              column, mask, epilogue, EPILOGUE, PRELOAD)
        total = tl.sum(values.to(tl.float32), axis=0)
        finish_loaded(round_to(total, dtype), operands, index, column, mask, epilogue, EPILOGUE,
                      ITEM)

    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


def lamport_one_shot_launch(x, buffer, out, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs); options as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    args = head + (buffer.data_table, buffer.epoch, x.numel(), slot_elements(x.numel()),
                   part_elements(buffer, x.element_size(), 2), buffer.rank, tuning.timeout_ns)
    # The poll holds a [W, row] tile: past 4 ranks, twice the warps keep it near 64 elements a
    # thread (for rows up to 8192).
    if buffer.world_size > 4:
        kwargs["num_warps"] = min(16, 2 * layout.num_warps)
    kwargs.update(MAX_PROGRAMS=MAX_PROGRAMS, PRELOAD=tuning.preload)
    kwargs.update(pdl_options(tuning, x))
    return lamport_one_shot_kernel, (layout.grid,), args, kwargs


# The plain callable (torch's equivalent in SymmKernel.__call__); the same two halves of W
# slots as the one-shot kernel.
lamport_one_shot_all_reduce = SymmKernel("one_shot_lamport", lamport_one_shot_launch,
                                         one_shot_bytes, lamport=True)
