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
from infini_dist.kernels.symm_call import SymmKernel
from infini_dist.kernels.symm_chain import MAX_PROGRAMS, fused_arguments
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, call_half, pdl_options, program_items,
                                             push_items, reduce_slots, wait_for_predecessor)


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def one_shot_all_reduce_kernel(
        x_ptr, prologue, epilogue, data_table, signal_table, epoch_ptr, numel, slot_stride,
        half_stride, rank, timeout_ns, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr,
        ITEM: tl.constexpr, BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
        WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr, ON_GPU: tl.constexpr,
        PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    calls, half = call_half(epoch_ptr, pid, half_stride)

    # Push: this rank's items, prologue applied, into slot `rank` of every peer.
    push_items(x_ptr, data_table, rank, half + rank * slot_stride, first_item, items, programs,
               numel, prologue, PROLOGUE, ITEM, BLOCK, WORLD_SIZE, False)

    # Barrier, then the W slots summed in rank order, in fp32, then the epilogue.
    reduce_slots(x_ptr, epilogue, data_table, signal_table, epoch_ptr, calls, half, pid,
                 programs, first_item, items, numel, slot_stride, rank, timeout_ns, EPILOGUE,
                 ITEM, BLOCK, MAX_PROGRAMS, WORLD_SIZE, WS_P2, ON_GPU)


def one_shot_bytes(numel: int, element_size: int, world_size: int, row_len=None,
                   norm: int = 0) -> int:
    """Data bytes one call needs: two halves of `world_size` slots (rows do not matter)."""
    return 2 * world_size * slot_elements(numel) * element_size


def one_shot_launch(x, buffer, out, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs) with the launch options in kwargs; options
    as in symm_chain.fused_arguments."""
    layout, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    args = head + (buffer.data_table, buffer.signal_table, buffer.epoch, x.numel(),
                   slot_elements(x.numel()), part_elements(buffer, x.element_size(), 2),
                   buffer.rank, tuning.timeout_ns)
    kwargs["MAX_PROGRAMS"] = MAX_PROGRAMS
    kwargs.update(pdl_options(tuning, x))
    return one_shot_all_reduce_kernel, (layout.grid,), args, kwargs


# The plain callable, e.g. one_shot_all_reduce(x, group=g, epilogue=(("relu",),)): torch's
# equivalent in SymmKernel.__call__ (every rank reads all W copies: one barrier).
one_shot_all_reduce = SymmKernel("one_shot", one_shot_launch, one_shot_bytes, lamport=False)
