"""Sequence parallelism's span in one launch: reduce-scatter by rows, the epilogue on the rank's
own rows, all-gather of the result, through symmetric memory.

Unfused torch equivalent (x: [W * n, ...], every rank's partial sums; the residual, sides and
outputs of the epilogue are shards [n, ...]):
    shard = torch.empty(n, ...); dist.reduce_scatter_tensor(shard, x)     # rank r: rows r*n..
    out, h = epilogue(shard)                        # e.g. h = shard + residual; out = rms_norm(h)
    gathered = torch.empty(W * n, ...); dist.all_gather_into_tensor(gathered, out)

Rows are the last dim's rows; rank q owns shard rows [q*R, (q+1)*R) of the flattened tensor,
which is dim 0's chunk q. Phase 1: each rank pushes its rows of chunk q into staging slot
`rank` of owner q. Barrier. Phase 2: each owner sums its slots in rank order 0..W-1 in fp32 (the
same order everywhere, hence the same bits as one reduction), rounds to the dtype like the
reduce_scatter output, and runs the epilogue on whole rows (symm_chain.finish_item, with
shard-local offsets): its side outputs (the new residual, the rsqrt) go to this rank's tensors,
`out` to this rank's gathered region. Barrier (also without a gather: it keeps a peer's next
launch from writing staging rows this rank still sums). Phase 3 (GATHER): each rank copies
every owner's gathered region into its place in the gathered output. Program p handles shard
rows p, p + grid, ... in every phase, so its barrier orders exactly the rows it moves.

Staging fills the lower half of the buffer and the gathered region starts at its upper half, at
offsets that do not depend on the shape: a rank that has left this launch writes peers' staging
in its next one before any barrier, while a peer may still copy gathered regions here. A
rank writes its own gathered region only after the next launch's first barrier, which every
peer reaches only once its previous launch, phase 3 included, is over (one stream).

Last come the launch builder the engine binds (scheduler/backends/symm_scatter.py) and the
plain callable: `out, residual = reduce_scatter_all_gather(x, group=g, weight=w, residual=r)`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.symm_buffers import header_bytes, slot_elements, upper_half_elements
from infini_dist.kernels.symm_call import (call_buffer, call_outputs, chain_ops, checked_input,
                                           norm_options, quant_options, world_size_of)
from infini_dist.kernels.symm_chain import MAX_ROW, QUANT_CODES, fused_arguments
from infini_dist.kernels.symm_device import DEFAULT_TUNING, apply_prologue, finish
from infini_dist.kernels.symm_signal import block_barrier, peer_pointer


# `rows` is never specialized: Triton makes an int argument equal to 1 a constexpr, which has
# no .to() (a one-row shard failed to compile on GPUs; the interpreter does not specialize)
@triton.jit(do_not_specialize=["rows", "rank", "timeout_ns"])
def reduce_scatter_all_gather_kernel(
        x_ptr, prologue, epilogue, gathered_ptr, data_table, signal_table, rows, gather_offset,
        rank, timeout_ns, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ROW: tl.constexpr,
        BLOCK: tl.constexpr, GATHER: tl.constexpr, WORLD_SIZE: tl.constexpr,
        WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    in_row = column < ROW
    shard = rows.to(tl.int64) * ROW
    first = pid.to(tl.int64)

    for row in range(first, rows, programs):  # phase 1: chunk q's rows to owner q
        for step in tl.static_range(WORLD_SIZE):
            owner = (rank + step) % WORLD_SIZE  # staggered, so owners are not all hit at once
            index = (owner * rows + row) * ROW + column
            x = tl.load(x_ptr + index, mask=in_row, other=0.0).to(tl.float32)
            x = apply_prologue(x, index, in_row, prologue, PROLOGUE, dtype)
            staging = peer_pointer(data_table, owner, dtype) + rank * shard
            tl.store(staging + row * ROW + column, x.to(dtype), mask=in_row)
    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    local = peer_pointer(data_table, rank, dtype)
    for row in range(first, rows, programs):  # phase 2: own rows summed, epilogue
        index = row * ROW + column
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(local + source * shard + index, mask=in_row, other=0.0).to(
                tl.float32)
        finish(total.to(dtype).to(tl.float32), index, column, in_row, epilogue, EPILOGUE, ROW)

    # Also without a gather: a peer that finished this launch may start the next one, whose
    # phase 1 writes this rank's staging before any barrier, while these rows are still summed.
    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
    if GATHER:  # phase 3: every owner's rows into the gathered output
        out_dtype = gathered_ptr.dtype.element_ty
        for row in range(first, rows, programs):
            for step in tl.static_range(WORLD_SIZE):
                owner = (rank + step) % WORLD_SIZE
                region = peer_pointer(data_table, owner, out_dtype) + gather_offset
                value = tl.load(region + row * ROW + column, mask=in_row, other=0.0)
                tl.store(gathered_ptr + (owner * rows + row) * ROW + column, value, mask=in_row)


KIND = "reduce_scatter_all_gather"  # its buffers' key: launches of other protocols never share them
MAX_PROGRAMS = 128  # at most one per SM, so that program b of every rank is resident
# `out`'s dtype by quant code where quantized (else x's): from the options, never from `out`.
_QUANT_DTYPES = {code: SPECS[name].out_dtype for name, code in QUANT_CODES.items()}


def data_bytes(shard_numel: int, element_size: int, world_size: int) -> int:
    """Buffer bytes one call needs: two halves, the lower holding W staging slots of a shard."""
    return 2 * slot_elements(world_size * shard_numel) * element_size + 512


def layout(rows: int, row_len: int) -> tuple[int, int, int]:
    """(BLOCK, grid, num_warps) for shards of `rows` rows: from shapes alone, so every rank
    launches the same grid."""
    block = triton.next_power_of_2(row_len)
    return block, max(1, min(rows, MAX_PROGRAMS)), 4 if block <= 2048 else 8 if block <= 8192 \
        else 16


def local_region(buffer, dtype, numel: int):
    """This rank's gathered region as a tensor of `dtype`: where phase 2 writes `out`."""
    start = header_bytes(buffer.world_size) + upper_half_elements(buffer, 1)
    return buffer.storage[start:start + numel * dtype.itemsize].view(dtype)


def shard_shape(x, world_size: int) -> tuple:
    """A rank's shard of x [W * n, ...]: [n, ...]."""
    if x.dim() == 0 or x.shape[0] % world_size:
        raise ValueError(f"x's dim 0 must split evenly over {world_size} ranks, got shape "
                         f"{tuple(x.shape)}")
    return (x.shape[0] // world_size,) + tuple(x.shape[1:])


def shard_rows(x, world_size: int) -> tuple[int, int]:
    """(rows, row length) of a rank's shard of x [W * n, ...], or ValueError where a program
    cannot hold a row."""
    shard = shard_shape(x, world_size)
    row = shard[-1]
    if row > MAX_ROW:
        raise ValueError(f"rows of at most {MAX_ROW} (a program holds a whole row), got {row}")
    return math.prod(shard) // row, row


def shard_call(x, group, buffer, epilogue, weight, residual, eps, norm, bias, quant):
    """What a plain callable over x [W * n, ...] checks and allocates before its launch:
    (x contiguous, world size, launch options, (out, scales, pre) of the shard's shape)."""
    x = checked_input(x)
    world_size = world_size_of(group, buffer)
    shard_rows(x, world_size)  # refused before a collective buffer is allocated
    shard = x[:x.shape[0] // world_size]  # what the epilogue's operands must be like
    sides = {}
    options = dict(epilogue=chain_ops(epilogue, shard, sides), sides=sides, eps=float(eps),
                   **norm_options(shard, norm, weight, bias, residual), **quant_options(quant))
    return x, world_size, options, call_outputs(shard, quant, residual)


def reduce_scatter_all_gather_launch(x, buffer, out, gathered, *, tuning=DEFAULT_TUNING,
                                     **options):
    """The launch, as (kernel, grid, args, kwargs). x: [W * n, ...]. Either `out`, the
    epilogue's value on this rank's shard [n, ...], or `gathered`, [W * n, ...] in out's dtype
    (then `out` is this rank's gathered region of the buffer, and gathered[rank * n:] its
    value). Options as in symm_chain.fused_arguments, their tensors shards (sides, residual,
    pre, rstd, scales); row_len is the shard's last dim whatever is passed. Like
    fused_arguments it reads x's shape, dtype and device, never `out` or `gathered`, so the
    engine binds it once with stand-ins for them (nt_runtime.FastLaunch)."""
    if (out is None) == (gathered is None):
        raise ValueError("pass `out` (the shard's value) or `gathered`, not both")
    rows, row = shard_rows(x, buffer.world_size)
    out_dtype = _QUANT_DTYPES.get(options.get("quant", 0), x.dtype)
    if gathered is not None:
        out = local_region(buffer, out_dtype, rows * row)
    _, head, kwargs = fused_arguments(x, buffer, out, fold_row_max=tuning.fold_row_max,
                                      **dict(options, row_len=row))
    block, grid, warps = layout(rows, row)
    del kwargs["ITEM"]
    kwargs.update(ROW=row, BLOCK=block, GATHER=gathered is not None, num_warps=warps)
    args = head + (x if gathered is None else gathered, buffer.data_table, buffer.signal_table,
                   rows, upper_half_elements(buffer, out_dtype.itemsize), buffer.rank,
                   tuning.timeout_ns)
    return reduce_scatter_all_gather_kernel, (grid,), args, kwargs


def reduce_scatter_all_gather(x, *, group=None, epilogue=(), weight=None, residual=None,
                              eps=1e-6, norm="rms_norm", bias=None, quant=None, gather=True,
                              buffer=None, tuning=DEFAULT_TUNING):
    """x [W * n, ...] (this rank's partial sums of every rank's rows) reduce-scattered over
    `group`, the epilogue run on this rank's shard and, with `gather`, its value all-gathered:
    one launch. Collective: every rank of `group` calls it with the same shapes, dtypes and
    steps. Unfused torch equivalent (every step computes in fp32 and rounds to x.dtype):

        y = torch.empty_like(x[:n]); dist.reduce_scatter_tensor(y, x, group=group)
        for step in epilogue: y = step(y)               # side tensors: shards [n, ...]
        if residual is not None:                        # [n, ...]; returned after the scales
            residual = y + residual; y = residual
        y = rms_norm(y, weight, eps) if weight is not None else y
        y = quantizer(y) if quant is not None else y    # its per-row scales: [n, ..., 1]
        if gather:
            out = torch.empty_like(x, dtype=y.dtype)
            dist.all_gather_into_tensor(out, y, group=group); y = out
        return y                                        # then (y[, scales][, residual])

    Only `out` is gathered: the scales and the residual are this rank's shard. The sums are
    fp32 in rank order, so every rank gathers the same bits. `epilogue`, `norm`, `bias`,
    `quant`, `buffer` and `tuning` as in symm_call.SymmKernel.__call__; no prologue."""
    x, world_size, options, (out, scales, pre) = shard_call(
        x, group, buffer, epilogue, weight, residual, eps, norm, bias, quant)
    size = data_bytes(out.numel(), max(x.element_size(), out.element_size()), world_size)
    buffer = call_buffer(buffer, group, x.device, KIND, size)
    gathered = torch.empty_like(x, dtype=out.dtype) if gather else None
    kernel, grid, args, kwargs = reduce_scatter_all_gather_launch(
        x, buffer, None if gather else out, gathered, pre=pre, scales=scales, tuning=tuning,
        **options)
    kernel[grid](*args, **kwargs)
    results = tuple(t for t in (gathered if gather else out, scales, pre) if t is not None)
    return results if len(results) > 1 else results[0]
