"""Sequence parallelism's span in one launch with one barrier: every rank reduces and runs the
epilogue on every row, through symmetric memory. The latency-oriented sibling of
kernels/reduce_scatter_all_gather.py (two barriers, three phases) for small token counts.

Unfused torch equivalent (x: [W * n, ...], every rank's partial sums; the residual and the side
outputs of the epilogue are shards [n, ...]):
    shard = torch.empty(n, ...); dist.reduce_scatter_tensor(shard, x)     # rank r: rows r*n..
    out, h = epilogue(shard)                        # e.g. h = shard + residual; out = rms_norm(h)
    gathered = torch.empty(W * n, ...); dist.all_gather_into_tensor(gathered, out)

Every rank pushes its whole x into slot `rank` of every peer's buffer, and its residual shard
into residual slot `rank`. Barrier. Then every rank sums every row of x over the W slots in rank
order 0..W-1 in fp32 and rounds to the dtype, exactly as reduce_scatter_all_gather's owner does
for its rows, and runs the epilogue on it (symm_chain.finish_item at shard-local offsets, with
the residual of the row's owner q from residual slot q): `out` goes straight to the row's place
in the gathered output, so every rank gathers the same bits as reduce_scatter_all_gather does.
The side outputs (the new residual, the rsqrt) are stored for this rank's own rows only: rows of
other owners run with a second epilogue code whose writes are off (OTHERS). What the epilogue
reads besides the sum and the residual (the norm's weight and bias, vector operands) is this
rank's, for every row: the same on every rank as SequenceParallel replicates them. A per-row
quantizer's scales and shard-shaped chain operands would need every rank's, which are not
pushed: `unsupported` refuses them.

Buffer reuse is the one-shot all-reduce's (kernels/one_shot_all_reduce.py): two halves at
shape-independent offsets, used on alternate calls by the parity of a call counter kept on the
device; the barrier of call n+1 proves every peer finished call n, so one barrier per call
suffices. Program p handles the rows r of x with r % grid == p in both phases, taken owner by
owner (the owner known at compile time relative to this rank, so that own rows get EPILOGUE),
so its barrier orders exactly the rows it reads.

Last come the launch builder the engine binds (scheduler/backends/symm_scatter.py) and the
plain callable: `out, residual = one_shot_scatter_gather(x, group=g, weight=w, residual=r)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infini_dist.kernels.reduce_scatter_all_gather import layout, shard_call, shard_rows
from infini_dist.kernels.symm_buffers import slot_elements, upper_half_elements
from infini_dist.kernels.symm_call import call_buffer
from infini_dist.kernels.symm_chain import (CODES, MAX_PROGRAMS, ROW_SCALE_QUANTS,
                                            SCALE_OPERAND_QUANTS, STEPS,
                                            fused_arguments, round_to)
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, advance_epoch, apply_prologue,
                                             call_half, epilogue_operands, finish_into,
                                             push_to_peers)
from infini_dist.kernels.symm_signal import block_barrier, peer_pointer


@triton.jit
def first_row(pid, owner, rows, programs):
    """The first of `owner`'s shard rows i that program `pid` handles: x's row owner*rows + i
    is the program's when it is pid modulo the grid."""
    return (pid - owner * rows % programs + programs) % programs


# `rows` is never specialized: Triton makes an int argument equal to 1 a constexpr, which has
# no .to() (a one-row shard failed to compile on GPUs; the interpreter does not specialize)
@triton.jit(do_not_specialize=["rows", "rank", "timeout_ns"])
def one_shot_scatter_gather_kernel(
        x_ptr, prologue, epilogue, data_table, signal_table, epoch_ptr, rows, slot_stride,
        residual_stride, half_stride, rank, timeout_ns, PROLOGUE: tl.constexpr,
        EPILOGUE: tl.constexpr, OTHERS: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
        MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr,
        ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first = pid.to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    in_row = column < ROW
    shard = rows.to(tl.int64) * ROW
    calls, half = call_half(epoch_ptr, pid, half_stride)
    residuals = half + WORLD_SIZE * slot_stride  # the residual slots follow x's

    for step in tl.static_range(WORLD_SIZE):  # push: all of x to slot `rank` of every peer
        owner = (rank + step) % WORLD_SIZE
        for row in range(first_row(first, owner, rows, programs), rows, programs):
            index = owner * shard + row * ROW + column
            x = tl.load(x_ptr + index, mask=in_row, other=0.0).to(tl.float32)
            x = apply_prologue(x, index, in_row, prologue, PROLOGUE, dtype).to(dtype)
            push_to_peers(data_table, rank, half + rank * slot_stride + index, x, in_row,
                          WORLD_SIZE)
            if step == 0 and EPILOGUE[4]:  # this rank's residual rows: every rank's program
                # that reads them is this program's peer, so its barrier orders them
                local = row * ROW + column
                residual = tl.load(epilogue[6] + local, mask=in_row, other=0.0)
                push_to_peers(data_table, rank, residuals + rank * residual_stride + local,
                              residual, in_row, WORLD_SIZE)
    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    data = peer_pointer(data_table, rank, dtype)
    for step in tl.static_range(WORLD_SIZE):  # every row summed in rank order, its epilogue
        owner = (rank + step) % WORLD_SIZE
        out = epilogue[0] + owner * shard  # so that finish's shard-local offsets land there
        residual = data + residuals + owner * residual_stride
        for row in range(first_row(first, owner, rows, programs), rows, programs):
            index = row * ROW + column
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for source in tl.static_range(WORLD_SIZE):
                total += tl.load(data + half + source * slot_stride + owner * shard + index,
                                 mask=in_row, other=0.0).to(tl.float32)
            if step == 0:
                operands = epilogue_operands(index, column, in_row, epilogue, EPILOGUE, residual)
                finish_into(round_to(total, dtype), operands, index, column, in_row, epilogue,
                            EPILOGUE, ROW, out)
            else:
                operands = epilogue_operands(index, column, in_row, epilogue, OTHERS, residual)
                finish_into(round_to(total, dtype), operands, index, column, in_row, epilogue,
                            OTHERS, ROW, out)
    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


KIND = "one_shot_scatter_gather"  # its buffers' key: launches of other protocols never share them
_ROW_SIDES = frozenset(CODES[name] for name, step in STEPS.items() if step.side == "row")


def unsupported(epilogue: tuple = (), quant: int = 0) -> str | None:
    """Why the kernel cannot run an epilogue of these ChainOps and quant code (None: it can):
    every rank runs it on every row, with no other rank's data but x and the residual."""
    if quant in ROW_SCALE_QUANTS:
        return ("a per-row quantizer's scales: the one-shot stores only this rank's side "
                "outputs (reduce_scatter_all_gather runs it)")
    if quant in SCALE_OPERAND_QUANTS:
        return ("a scale tensor: every rank would quantize every rank's rows with its own "
                "scale, not theirs (reduce_scatter_all_gather runs it)")
    if any(op.code in _ROW_SIDES for op in epilogue):
        return ("a chain step with a shard-shaped operand: the one-shot has no other rank's "
                "(reduce_scatter_all_gather runs it)")
    return None


def _check(options: dict) -> None:
    why = unsupported(options.get("epilogue", ()), options.get("quant", 0))
    if why is not None:
        raise ValueError(f"one_shot_scatter_gather cannot run {why}")


def data_bytes(shard_numel: int, element_size: int, world_size: int) -> int:
    """Buffer bytes one call needs: two halves, each W slots of x [W * n, ...] and W residual
    slots of a shard."""
    half = world_size * (slot_elements(world_size * shard_numel) + slot_elements(shard_numel))
    return 2 * half * element_size + 512


def one_shot_scatter_gather_launch(x, buffer, gathered, *, tuning=DEFAULT_TUNING, **options):
    """The launch, as (kernel, grid, args, kwargs). x: [W * n, ...]; `gathered` [W * n, ...] in
    `out`'s dtype. Options as in symm_chain.fused_arguments, their tensors shards (residual,
    pre, rstd, reduced), but no per-row scales or shard-shaped chain operands (`unsupported`);
    row_len is the shard's last dim whatever is passed. Reads x's shape, dtype and device only,
    never `gathered`, so the engine binds it once with a stand-in for it
    (nt_runtime.FastLaunch)."""
    rows, row = shard_rows(x, buffer.world_size)
    _check(options)
    _, head, kwargs = fused_arguments(x, buffer, gathered, fold_row_max=tuning.fold_row_max,
                                      **dict(options, row_len=row))
    block, _, warps = layout(rows, row)  # reduce_scatter_all_gather's warps: the same row sums
    del kwargs["ITEM"]
    codes = kwargs["EPILOGUE"]  # (ops x 3, norm, residual, pre, rstd, reduced, quant, peak)
    kwargs.update(OTHERS=codes[:5] + (False, False, False) + codes[8:], ROW=row, BLOCK=block,
                  MAX_PROGRAMS=MAX_PROGRAMS, num_warps=warps)
    args = head + (buffer.data_table, buffer.signal_table, buffer.epoch, rows,
                   slot_elements(x.numel()), slot_elements(rows * row),
                   upper_half_elements(buffer, x.element_size()), buffer.rank, tuning.timeout_ns)
    grid = max(1, min(buffer.world_size * rows, MAX_PROGRAMS))
    return one_shot_scatter_gather_kernel, (grid,), args, kwargs


def one_shot_scatter_gather(x, *, group=None, epilogue=(), weight=None, residual=None,
                            eps=1e-6, norm="rms_norm", bias=None, quant=None, buffer=None,
                            tuning=DEFAULT_TUNING):
    """x [W * n, ...] (this rank's partial sums of every rank's rows) reduce-scattered over
    `group`, the epilogue run on every shard and its value all-gathered: one launch, one
    barrier, every rank reducing all of x. Collective: every rank of `group` calls it with the
    same shapes, dtypes and steps, and the same weight, bias and vector operands. Unfused torch
    equivalent (every step computes in fp32 and rounds to x.dtype):

        y = torch.empty_like(x[:n]); dist.reduce_scatter_tensor(y, x, group=group)
        for step in epilogue: y = step(y)               # no shard-shaped side tensors
        if residual is not None:                        # [n, ...]; returned after `out`
            residual = y + residual; y = residual
        y = rms_norm(y, weight, eps) if weight is not None else y
        y = quantizer(y) if quant is not None else y    # a per-tensor one only
        out = torch.empty_like(x, dtype=y.dtype)
        dist.all_gather_into_tensor(out, y, group=group)
        return out                                      # then (out, residual)

    The sums are fp32 in rank order: every rank gathers the same bits, those of
    reduce_scatter_all_gather. `epilogue`, `norm`, `bias`, `quant`, `buffer` and `tuning` as
    in symm_call.SymmKernel.__call__; no prologue."""
    x, world_size, options, (out, _, pre) = shard_call(
        x, group, buffer, epilogue, weight, residual, eps, norm, bias, quant)
    _check(options)  # before a collective buffer is allocated
    buffer = call_buffer(buffer, group, x.device, KIND,
                         data_bytes(out.numel(), x.element_size(), world_size))
    gathered = torch.empty_like(x, dtype=out.dtype)
    kernel, grid, args, kwargs = one_shot_scatter_gather_launch(x, buffer, gathered, pre=pre,
                                                                tuning=tuning, **options)
    kernel[grid](*args, **kwargs)
    return (gathered, pre) if pre is not None else gathered
