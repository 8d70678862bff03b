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
previous launch, phase 3 included. The staging slots fill the lower half of the buffer and the
gathered copy starts at its upper half, at offsets that do not depend on the shape: a peer that
has passed the last barrier may start the next launch, of a bigger shape, while this rank still
runs the last phase 3; placed after the staging of each shape, the gathered copy being read
would lie under that bigger launch's staging.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import slot_elements, upper_half_elements
from infini_dist.kernels.symm_call import SymmKernel
from infini_dist.kernels.symm_chain import fused_arguments, launch_layout
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, SymmTuning, finish_items, group_items,
                                             pdl_options, program_items, reduce_items,
                                             scatter_items, staging_targets, wait_for_predecessor)
from infini_dist.kernels.symm_signal import block_barrier, peer_pointer


@triton.jit(do_not_specialize=["rank", "timeout_ns", "round_items"])
def two_shot_all_reduce_kernel(
        x_ptr, prologue, epilogue, data_table, signal_table, numel, gather_offset, rank,
        timeout_ns, round_items, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ITEM: tl.constexpr,
        BLOCK: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr, GROUP: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr,
        PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    dtype = x_ptr.dtype.element_ty
    # Data area: W staging slots of items * SUB elements; at gather_offset, the gathered copy.
    stage_stride = items * SUB
    gathered = gather_offset
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
        scatter_items(x_ptr, staging_of, tile, tile_ok, first, last, programs, numel, prologue,
                      PROLOGUE, ITEM, SUB, SUB_BLOCK, GROUP)
        block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
        reduce_items(data_table, local, stage_stride, gathered, rank, first, last, programs,
                     numel, dtype, ITEM, SUB, SUB_BLOCK, WORLD_SIZE, GROUP, False)
        finish_items(local, gathered, previous_first, previous_last, programs, numel, epilogue,
                     EPILOGUE, ITEM, BLOCK, GROUP, False, False, timeout_ns, rank, ON_GPU)
        block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
        previous_first = first
        previous_last = last
    finish_items(local, gathered, previous_first, previous_last, programs, numel, epilogue,
                 EPILOGUE, ITEM, BLOCK, GROUP, False, False, timeout_ns, rank, ON_GPU)


def two_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                   norm: int = 0) -> int:
    """Data bytes one call needs: two halves the size of the staging slots (which hold at least
    the tensor, so the gathered copy fits in one), and the halves' alignment."""
    layout = launch_layout(numel, row_len, norm, world_size)
    staging = world_size * triton.cdiv(numel, layout.item) * layout.sub
    return 2 * slot_elements(staging) * element_size + 512


def round_items(items: int, grid: int, tuning: SymmTuning = DEFAULT_TUNING) -> int:
    """Items per program per round: 16 once a program has 32 or more (overlapping phase 3 with
    the next round's transfers measured faster at 8192 x 4096 bf16 on 4 H200s; see
    docs/notes_symm.md), else one round. tuning.round_items = n > 0 forces n."""
    if tuning.round_items > 0:
        return tuning.round_items
    per_program = triton.cdiv(items, grid)
    return 16 if per_program >= 32 else max(1, per_program)


def two_shot_launch(x, buffer, out, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs) with the launch options in kwargs; options
    as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    items = triton.cdiv(x.numel(), layout.item)
    args = head + (buffer.data_table, buffer.signal_table, x.numel(),
                   upper_half_elements(buffer, x.element_size()), buffer.rank,
                   tuning.timeout_ns, round_items(items, layout.grid, tuning))
    kwargs.update(SUB=layout.sub, SUB_BLOCK=layout.sub_block,
                  GROUP=group_items(items, layout.grid, tuning))
    kwargs.update(pdl_options(tuning, x))
    return two_shot_all_reduce_kernel, (layout.grid,), args, kwargs


# The plain callable (torch's equivalent in SymmKernel.__call__).
two_shot_all_reduce = SymmKernel("two_shot", two_shot_launch, two_shot_bytes, lamport=False)
