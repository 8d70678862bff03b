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
from infini_dist.kernels.symm_call import SymmKernel
from infini_dist.kernels.symm_chain import MAX_PROGRAMS, fused_arguments, launch_layout
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, advance_epoch, apply_prologue,
                                             call_half, finish_items, pdl_options, program_items,
                                             push_to_peers, staging_targets, wait_for_predecessor)
from infini_dist.kernels.symm_signal import never_empty, peer_pointer, take


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def lamport_two_shot_kernel(
        x_ptr, prologue, epilogue, data_table, epoch_ptr, numel, half_stride, rank, timeout_ns,
        PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr,
        SUB: tl.constexpr, SUB_BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr,
        PRELOAD: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    dtype = x_ptr.dtype.element_ty
    calls, half = call_half(epoch_ptr, pid, half_stride)
    # A half: W staging slots of items * SUB elements, then the gathered copy (like x).
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
        x = apply_prologue(x, index, mask, prologue, PROLOGUE, dtype)
        tl.store(staging_of[:, None] + (item * SUB + sub)[None, :], never_empty(x.to(dtype)),
                 mask=mask)

    # Phase 2: this rank's sub-shard, polled from the W sources and summed as one
    # [source, sub-shard] tile, to every rank's gathered copy.
    owned = rank * SUB + sub
    for item in range(first_item, items, programs):
        index = item * ITEM + owned
        mask = (sub < SUB) & (owned < ITEM) & (index < numel)
        places = local + half + (ranks * stage_stride)[:, None] + (item * SUB + sub)[None, :]
        values = take(places, rank_ok[:, None] & mask[None, :], timeout_ns, rank, ON_GPU)
        reduced = never_empty(tl.sum(values.to(tl.float32), axis=0).to(dtype))
        push_to_peers(data_table, rank, gathered + index, reduced, mask, WORLD_SIZE)

    # Phase 3: the epilogue over whole items of the local gathered copy, each polled.
    finish_items(local, gathered, first_item, items, programs, numel, epilogue, EPILOGUE, ITEM,
                 BLOCK, 1, True, PRELOAD, timeout_ns, rank, ON_GPU)

    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


def lamport_two_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                           norm: int = 0) -> int:
    """Data bytes one call needs: two halves, each W staging slots plus the gathered copy."""
    layout = launch_layout(numel, row_len, norm, world_size)
    half = world_size * triton.cdiv(numel, layout.item) * layout.sub + numel
    return 2 * slot_elements(half) * element_size


def lamport_two_shot_launch(x, buffer, out, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs); options as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    args = head + (buffer.data_table, buffer.epoch, x.numel(),
                   part_elements(buffer, x.element_size(), 2), buffer.rank, tuning.timeout_ns)
    kwargs.update(SUB=layout.sub, SUB_BLOCK=layout.sub_block, MAX_PROGRAMS=MAX_PROGRAMS,
                  PRELOAD=tuning.preload,
                  # Half the barrier kernel's warps: measured faster at 128 x 4096 bf16 on 4 H200s
                  # (docs/notes_symm.md, session 2).
                  num_warps=max(4, layout.num_warps // 2))
    kwargs.update(pdl_options(tuning, x))
    return lamport_two_shot_kernel, (layout.grid,), args, kwargs


# The plain callable (torch's equivalent in SymmKernel.__call__).
lamport_two_shot_all_reduce = SymmKernel("two_shot_lamport", lamport_two_shot_launch,
                                         lamport_two_shot_bytes, lamport=True)
