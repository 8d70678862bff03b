"""Two-shot all-reduce with one barrier: the reduce-scatter behind a block barrier, the all-gather
polled (Lamport signalling), fused.

Unfused torch equivalent:
    x = prologue(x); dist.all_reduce(x)          # every op rounds to x.dtype
    out = epilogue(x)                              # chain, then optional (add_)rms_norm

Phase 1 and the barrier are those of the two-shot kernel. Then each program alternates: phase 2
(reduce and push) for a group of items, phase 3 (epilogue) for the previous group, whose gathered
rows it polls instead of waiting at a second barrier. The epilogue of a row starts as soon as its
W reduced sub-shards have landed, under the next group's transfers, and the call has one barrier
instead of two per round.

Reuse: the buffer has two halves at fixed offsets used on alternate calls, each a staging area
and a gathered copy, also at fixed offsets: staging is never emptied, so a gathered copy placed
after the staging of the current shape could sit on a previous shape's stale staging values and
read as already arrived. A peer's call n+1 writes the other half. Its call n+2 passes the barrier
of call n+2 only after this rank arrives there, i.e. after this rank's call n+1, so this rank has
read (and, for the gathered copy, emptied) the half of call n. Sums run in rank order in fp32
and every rank reads the owners' rounded results, so all ranks get bitwise identical outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_call import SymmKernel
from infini_dist.kernels.symm_chain import MAX_PROGRAMS, fused_arguments, launch_layout
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, advance_epoch, call_half,
                                             finish_items, group_items, pdl_options, program_items,
                                             reduce_items, scatter_items, staging_targets,
                                             wait_for_predecessor)
from infini_dist.kernels.symm_signal import block_barrier, peer_pointer


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def two_shot_polled_gather_kernel(
        x_ptr, prologue, epilogue, data_table, signal_table, epoch_ptr, numel, half_stride,
        gather_offset, rank, timeout_ns, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
        GROUP: tl.constexpr, MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr,
        WS_P2: tl.constexpr, ON_GPU: tl.constexpr, PRELOAD: tl.constexpr,
        PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    dtype = x_ptr.dtype.element_ty
    calls, half = call_half(epoch_ptr, pid, half_stride)
    # A half: W staging slots of items * SUB elements; at gather_offset, the gathered copy.
    stage_stride = items * SUB
    gathered = half + gather_offset
    local = peer_pointer(data_table, rank, dtype)
    staging_of, tile, tile_ok = staging_targets(data_table, half, rank, stage_stride, dtype,
                                                ITEM, SUB, SUB_BLOCK, WORLD_SIZE, WS_P2)
    scatter_items(x_ptr, staging_of, tile, tile_ok, first_item, items, programs, numel, prologue,
                  PROLOGUE, ITEM, SUB, SUB_BLOCK, GROUP)
    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    # Phase 2 of a group beside phase 3 (polled) of the previous one.
    step = programs * GROUP
    previous_first = first_item
    previous_last = first_item  # no previous group yet
    for first in range(first_item, items, step):
        last = tl.minimum(first + step, items)
        reduce_items(data_table, local + half, stage_stride, gathered, rank, first, last,
                     programs, numel, dtype, ITEM, SUB, SUB_BLOCK, WORLD_SIZE, GROUP, True)
        finish_items(local, gathered, previous_first, previous_last, programs, numel, epilogue,
                     EPILOGUE, ITEM, BLOCK, GROUP, True, PRELOAD, timeout_ns, rank, ON_GPU)
        previous_first = first
        previous_last = last
    finish_items(local, gathered, previous_first, previous_last, programs, numel, epilogue,
                 EPILOGUE, ITEM, BLOCK, GROUP, True, PRELOAD, timeout_ns, rank, ON_GPU)

    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


def polled_gather_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                        norm: int = 0) -> int:
    """Data bytes one call needs: two halves, each two areas the size of the W staging slots
    (which hold at least the tensor, so the gathered copy fits in one)."""
    layout = launch_layout(numel, row_len, norm, world_size)
    staging = world_size * triton.cdiv(numel, layout.item) * layout.sub
    return 4 * slot_elements(staging) * element_size


def two_shot_polled_gather_launch(x, buffer, out, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs); options as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    group = group_items(triton.cdiv(x.numel(), layout.item), layout.grid, tuning)
    # Halves start every half buffer; in each, the gathered copy a quarter buffer in.
    args = head + (buffer.data_table, buffer.signal_table, buffer.epoch, x.numel(),
                   part_elements(buffer, x.element_size(), 2),
                   part_elements(buffer, x.element_size(), 4), buffer.rank, tuning.timeout_ns)
    kwargs.update(SUB=layout.sub, SUB_BLOCK=layout.sub_block, GROUP=group,
                  MAX_PROGRAMS=MAX_PROGRAMS, PRELOAD=tuning.preload,
                  # About 32 elements of a [group, row] tile a thread: on 4 H200s, add_rms_norm
                  # x 4096 bf16 at 8192 tokens ran faster with 16 warps than with 8 (1024
                  # tokens: 8 warps; docs/notes_symm.md, session 2).
                  num_warps=max(4, min(16, group * layout.block // 1024)))
    kwargs.update(pdl_options(tuning, x))
    return two_shot_polled_gather_kernel, (layout.grid,), args, kwargs


# The plain callable (torch's equivalent in SymmKernel.__call__); its gathered copy is polled.
two_shot_polled_gather_all_reduce = SymmKernel("two_shot_polled_gather",
                                               two_shot_polled_gather_launch, polled_gather_bytes,
                                               lamport=True)
