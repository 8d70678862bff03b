"""All-gather through symmetric memory with Lamport signalling, in one launch: every rank's
tensor, stacked in rank order, on every rank.

Unfused torch equivalent:
    out = torch.empty((W * x.shape[0],) + x.shape[1:], dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)

The protocol is lamport_one_shot's (kernels/lamport_one_shot.py): every rank stores its items
into slot `rank` of every peer's buffer, readers poll the places they need until none holds the
empty pattern, copy them out and empty them, and two halves at fixed offsets are used on
alternate calls. No flag, fence or barrier is on the path, which is what makes a small gather
(a TP model's logits in a decode step) cost less than NCCL's.

Bits: a stored value is never the empty pattern (the bits of -0.0), so a -0.0 is sent as +0.0.
This rank's own part of `out` gets the same +0.0, so every rank holds the same bits; -0.0 is the
one value whose bits differ from torch's gather (it compares equal); every other value, NaNs
included, keeps its bits.

Last come the launch builder the engine binds (scheduler/backends/symm_gather.py) and the plain
callable: `out = lamport_all_gather(x, group=g)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_call import call_buffer, checked_input, world_size_of
from infini_dist.kernels.symm_chain import MAX_PROGRAMS
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, advance_epoch, call_half,
                                             item_range, pdl_options, program_items,
                                             wait_for_predecessor)
from infini_dist.kernels.symm_signal import never_empty, peer_pointer, take, world_size_pow2

KIND = "lamport_all_gather"  # its buffers' key: launches of other protocols never share them
ITEM_BYTES = 4096  # a program's item: 16 bytes a thread at 8 warps


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def lamport_all_gather_kernel(x_ptr, out_ptr, data_table, epoch_ptr, numel, slot_stride,
                              half_stride, rank, timeout_ns, ITEM: tl.constexpr,
                              MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr,
                              WS_P2: tl.constexpr, ON_GPU: tl.constexpr,
                              PDL: tl.constexpr = False):
    wait_for_predecessor(PDL, ON_GPU)
    pid, programs, first_item, items = program_items(numel, ITEM)
    calls, half = call_half(epoch_ptr, pid, half_stride)
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, ITEM)
    mine_at = half + rank * slot_stride

    # Push: this rank's items to every peer, and to its own part of out, never the empty pattern.
    for item in range(first_item, items, programs):
        index, mask = item_range(item, column, numel, ITEM)
        x = tl.load(x_ptr + index, mask=mask, other=0.0)
        x = never_empty(x)
        for step in tl.static_range(1, WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
            tl.store(peer_pointer(data_table, peer, dtype) + mine_at + index, x, mask=mask)
        tl.store(out_ptr + rank.to(tl.int64) * numel + index, x, mask=mask)

    # Gather: the same items of every other rank, polled, copied to their part of out, emptied.
    local = peer_pointer(data_table, rank, dtype) + half
    sources = tl.arange(0, WS_P2)[:, None]
    parts = sources.to(tl.int64) * numel  # where each rank's part of out starts
    for item in range(first_item, items, programs):
        index, mask = item_range(item, column, numel, ITEM)
        present = (sources < WORLD_SIZE) & (sources != rank) & mask[None, :]
        values = take(local + sources * slot_stride + index[None, :], present, timeout_ns, rank,
                      ON_GPU)
        tl.store(out_ptr + parts + index[None, :], values, mask=present)

    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


def data_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Data bytes one call needs: two halves of `world_size` slots."""
    return 2 * world_size * slot_elements(numel) * element_size


def lamport_all_gather_launch(x, buffer, out, *, tuning=DEFAULT_TUNING):
    """The launch, as (kernel, grid, args, kwargs): `x` contiguous, `out` W times its size."""
    numel = x.numel()
    item = ITEM_BYTES // x.element_size()
    grid = min(MAX_PROGRAMS, triton.cdiv(numel, item))
    args = (x, out, buffer.data_table, buffer.epoch, numel, slot_elements(numel),
            part_elements(buffer, x.element_size(), 2), buffer.rank, tuning.timeout_ns)
    kwargs = dict(ITEM=item, MAX_PROGRAMS=MAX_PROGRAMS, WORLD_SIZE=buffer.world_size,
                  WS_P2=world_size_pow2(buffer.world_size), ON_GPU=x.is_cuda, num_warps=8)
    kwargs.update(pdl_options(tuning, x))
    return lamport_all_gather_kernel, (grid,), args, kwargs


def lamport_all_gather(x, *, group=None, out=None, buffer=None, tuning=DEFAULT_TUNING):
    """`x` of every rank of `group`, stacked along dim 0 in rank order (see the module's
    docstring for the one difference in bits), into `out` where given (contiguous, W times x's
    rows, x's dtype and device), as all_gather_into_tensor writes its output. Collective: every
    rank calls it with the same shape and dtype. `buffer`: a symm_buffers.SymmBuffer to use
    (default: this kernel's cached symmetric buffer of `group`, allocated on first use, which
    needs CUDA)."""
    x = checked_input(x)  # its dtypes are the widths with an empty pattern
    world_size = world_size_of(group, buffer)
    shape = (world_size * x.shape[0],) + tuple(x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != x.dtype
          or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape} on "
                         f"{x.device}")
    buffer = call_buffer(buffer, group, x.device, KIND,
                         data_bytes(x.numel(), x.element_size(), world_size),
                         x.element_size() * 8)
    kernel, grid, args, kwargs = lamport_all_gather_launch(x, buffer, out, tuning=tuning)
    kernel[grid](*args, **kwargs)
    return out
