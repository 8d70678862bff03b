"""Device helpers of the symmetric-memory all-reduce kernels: the pieces every kernel file
composes, so that each kernel reads as signature, phases, launch.

- The program's share of the items (`program_items`, `item_range`, `item_group`): an item is a
  row (when a norm follows) or a chunk of ITEM elements; program p owns items p, p + grid, ...
- Call parity and the epoch (`call_half`, `advance_epoch`): kernels that reuse their buffer in
  two halves pick the half from a per-program call counter kept on the device.
- The push to peers (`push_to_peers`, and `push_items`, the one-shot kernels' first phase):
  stores only, staggered so peers are not all hit at once. The one-shot's second phase
  (`reduce_slots`: barrier, rank-order sums, epilogue), which the GEMM + all-reduce kernel
  (kernels/gemm_all_reduce.py) runs after its GEMM's pushes too.
- The chains (`apply_prologue`, `finish`, `finish_into`): the symm_chain ops, unpacked from
  the kernels' tuple arguments. A kernel takes `x_ptr, prologue, epilogue` with PROLOGUE =
  (OP0, OP1, OP2) and EPILOGUE = (OP0, OP1, OP2, NORM, RESIDUAL, WRITE_PRE, WRITE_RSTD,
  WRITE_REDUCED, QUANT, PEAK) constexpr, `prologue` = (scalar, side) x 3 and `epilogue` = (out, pre,
  rstd, reduced, weight, bias, residual, eps) + (scalar, side) x 3 + (quant scale, scales)
  (symm_chain.fused_arguments).
- The two-shot phases over groups of items (`staging_targets`, `scatter_items`, `reduce_items`,
  `finish_items`), shared by the barrier, Lamport and polled-gather two-shot kernels.

Barriers and Lamport signalling are in symm_signal; op codes and layouts in symm_chain.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infini_dist.kernels.symm_chain import (NO_NORM, apply_chain, finish_item, norm_operands,
                                            quant_operand, round_to)
from infini_dist.kernels.symm_signal import (DEFAULT_TIMEOUT_S, block_barrier, never_empty,
                                             peer_pointer, take)


@triton.jit
def program_items(numel, ITEM: tl.constexpr):
    """(pid, programs, first item, item count); items are int64, since offsets of big tensors
    overflow int32."""
    pid = tl.program_id(0)
    return pid, tl.num_programs(0), pid.to(tl.int64), tl.cdiv(numel, ITEM).to(tl.int64)


@triton.jit
def item_range(item, column, numel, ITEM: tl.constexpr):
    """Offsets of one item's elements along `column`, and which of them exist."""
    index = item * ITEM + column
    return index, (column < ITEM) & (index < numel)


@triton.jit
def item_group(start, last, programs, GROUP: tl.constexpr):
    """Items start, start + programs, ... (GROUP of them), and which of them are < last."""
    items = start + tl.arange(0, GROUP).to(tl.int64) * programs
    return items, items < last


@triton.jit
def call_half(epoch_ptr, pid, half_stride):
    """This program's call count and the offset of the half this call uses (its parity)."""
    calls = tl.load(epoch_ptr + pid)
    return calls, (calls % 2).to(tl.int64) * half_stride


@triton.jit
def advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS: tl.constexpr):
    """Count this call. Every slot s (not only those below the grid) is advanced, by program
    s % grid, so a later launch with another grid still reads the right parity."""
    slots = tl.arange(0, MAX_PROGRAMS)
    tl.store(epoch_ptr + slots, calls + 1, mask=(slots % programs) == pid)


@triton.jit
def push_to_peers(data_table, rank, offsets, values, mask, WORLD_SIZE: tl.constexpr):
    """Store `values` at element `offsets` of every rank's data, this rank's included."""
    for step in tl.static_range(WORLD_SIZE):
        peer = (rank + step) % WORLD_SIZE  # staggered, so peers are not all hit at once
        tl.store(peer_pointer(data_table, peer, values.dtype) + offsets, values, mask=mask)


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr, ON_GPU: tl.constexpr):
    """A kernel's first step under programmatic dependent launch (`pdl_options`): wait for the
    kernel before it on the stream (nothing before this reads what that one writes), then let
    the next launch start early."""
    if PDL and ON_GPU:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def apply_prologue(x, index, mask, chain, OPS: tl.constexpr, DTYPE: tl.constexpr):
    """The prologue chain on fp32 `x`; every op rounds to DTYPE."""
    return apply_chain(x, index, mask, OPS[0], chain[0], chain[1], OPS[1], chain[2], chain[3],
                       OPS[2], chain[4], chain[5], DTYPE)


@triton.jit
def epilogue_operands(index, column, mask, epilogue, OPS: tl.constexpr, residual_ptr):
    """The epilogue's reads that need no reduced value: (residual, weight, bias, quantizer's
    scale), as loaded. A Lamport kernel issues them before it polls, so that they arrive during
    the wait rather than one memory round trip after it. Without a norm no row is read (`index`
    fills in); a scale is read only by a quantizer whose scale is a tensor (an FP8
    checkpoint's), else it is the scalar argument."""
    residual = index
    weight = index
    bias = index
    if OPS[3] != NO_NORM:
        if OPS[4]:
            residual = tl.load(residual_ptr + index, mask=mask, other=0.0)
        weight, bias = norm_operands(column, mask, epilogue[4], epilogue[5], OPS[3])
    return residual, weight, bias, quant_operand(epilogue[14], epilogue[15], OPS[8])


@triton.jit
def take_with_operands(places, present, timeout_ns, rank, ON_GPU: tl.constexpr, index, column,
                       mask, epilogue, OPS: tl.constexpr, PRELOAD: tl.constexpr):
    """symm_signal.take of `places`, and the item's `epilogue_operands`: read before the wait
    where PRELOAD (SymmTuning.preload), so that their latency hides under it, else after it."""
    if PRELOAD:
        operands = epilogue_operands(index, column, mask, epilogue, OPS, epilogue[6])
    values = take(places, present, timeout_ns, rank, ON_GPU)
    if not PRELOAD:
        operands = epilogue_operands(index, column, mask, epilogue, OPS, epilogue[6])
    return values, operands


@triton.jit
def finish(y, index, column, mask, epilogue, OPS: tl.constexpr, ITEM: tl.constexpr):
    """symm_chain.finish_item (the epilogue chain, the norm, the stores) of the reduced `y`."""
    operands = epilogue_operands(index, column, mask, epilogue, OPS, epilogue[6])
    finish_loaded(y, operands, index, column, mask, epilogue, OPS, ITEM)


@triton.jit
def finish_loaded(y, operands, index, column, mask, epilogue, OPS: tl.constexpr,
                  ITEM: tl.constexpr):
    """`finish` with its `epilogue_operands` loaded already."""
    finish_into(y, operands, index, column, mask, epilogue, OPS, ITEM, epilogue[0])


@triton.jit
def finish_into(y, operands, index, column, mask, epilogue, OPS: tl.constexpr,
                ITEM: tl.constexpr, out_ptr):
    """`finish_loaded`, `out` stored at other places than the epilogue's: rows of another
    rank's shard (kernels/one_shot_scatter_gather.py, whose `operands` hold that shard's
    residual), their side outputs off in OPS."""
    finish_item(y, index, column, mask, out_ptr, epilogue[1], epilogue[2], epilogue[3],
                operands[0], operands[1], operands[2], epilogue[7], OPS[0], epilogue[8],
                epilogue[9], OPS[1], epilogue[10], epilogue[11], OPS[2], epilogue[12],
                epilogue[13], OPS[3], OPS[4], OPS[5], OPS[6], OPS[7], ITEM, OPS[8],
                operands[3], epilogue[15], OPS[9])


@triton.jit
def push_items(x_ptr, data_table, rank, offset, first, last, programs, numel, chain,
               OPS: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr,
               WORLD_SIZE: tl.constexpr, LAMPORT: tl.constexpr):
    """The one-shot push: items first, first + programs, ... < last, prologue applied, to
    element `offset` of every rank's data. LAMPORT: never store the empty pattern."""
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    for item in range(first, last, programs):
        index, mask = item_range(item, column, numel, ITEM)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_prologue(x, index, mask, chain, OPS, dtype).to(dtype)
        if LAMPORT:
            x = never_empty(x)
        push_to_peers(data_table, rank, offset + index, x, mask, WORLD_SIZE)


@triton.jit
def reduce_slots(x_ptr, epilogue, data_table, signal_table, epoch_ptr, calls, half, pid,
                 programs, first, items, numel, slot_stride, rank, timeout_ns,
                 OPS: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr,
                 MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr,
                 ON_GPU: tl.constexpr):
    """The one-shot's second half, after every rank has pushed its slot `rank` of `half`: a
    block barrier (program `pid` of every rank), then items first, first + programs, ... <
    items summed over the W slots in rank order in fp32, rounded once to x's dtype, the
    epilogue; last, this call is counted (the next one uses the other half)."""
    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    local = peer_pointer(data_table, rank, dtype) + half
    for item in range(first, items, programs):
        index, mask = item_range(item, column, numel, ITEM)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(local + source * slot_stride + index, mask=mask,
                             other=0.0).to(tl.float32)
        finish(round_to(total, dtype), index, column, mask, epilogue, OPS, ITEM)
    advance_epoch(epoch_ptr, calls, pid, programs, MAX_PROGRAMS)


# ---- the two-shot phases, GROUP items at a time ----------------------------------------------

@triton.jit
def staging_targets(data_table, offset, rank, stage_stride, dtype: tl.constexpr,
                    ITEM: tl.constexpr, SUB: tl.constexpr, SUB_BLOCK: tl.constexpr,
                    WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr):
    """Where phase 1 sends an item: owner q's staging slot `rank` (at element `offset` of its
    data), and the [owner, sub-shard] tile of item offsets that goes there, with its mask."""
    owners = tl.arange(0, WS_P2)
    owner_ok = owners < WORLD_SIZE
    sub = tl.arange(0, SUB_BLOCK)
    staging_of = tl.load(data_table + owners, mask=owner_ok, other=0)
    staging_of = tl.multiple_of(staging_of.to(tl.pointer_type(dtype)), 16) + offset
    staging_of += rank * stage_stride
    tile = owners[:, None] * SUB + sub[None, :]
    tile_ok = owner_ok[:, None] & (sub < SUB)[None, :] & (tile < ITEM)
    return staging_of, tile, tile_ok


@triton.jit
def scatter_items(x_ptr, staging_of, tile, tile_ok, first, last, programs, numel, chain,
                  OPS: tl.constexpr, ITEM: tl.constexpr, SUB: tl.constexpr,
                  SUB_BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Phase 1 for items first, first + programs, ... < last: GROUP items at a time move as a
    [item, owner, sub-shard] tile (all their loads in flight together), row q to owner q."""
    dtype = x_ptr.dtype.element_ty
    sub = tl.arange(0, SUB_BLOCK)
    for start in range(first, last, programs * GROUP):
        items, valid = item_group(start, last, programs, GROUP)
        index = items[:, None, None] * ITEM + tile[None, :, :]
        mask = valid[:, None, None] & tile_ok[None, :, :] & (index < numel)
        x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
        x = apply_prologue(x, index, mask, chain, OPS, dtype)
        places = staging_of[None, :, None] + (items[:, None] * SUB + sub[None, :])[:, None, :]
        tl.store(places, x.to(dtype), mask=mask)


@triton.jit
def reduce_items(data_table, staging, stage_stride, gathered, rank, first, last, programs,
                 numel, dtype: tl.constexpr, ITEM: tl.constexpr, SUB: tl.constexpr,
                 SUB_BLOCK: tl.constexpr, WORLD_SIZE: tl.constexpr, GROUP: tl.constexpr,
                 LAMPORT: tl.constexpr):
    """Phase 2: sum this rank's sub-shard over its staging slots (at `staging`) in rank order,
    push it to every rank's gathered copy (at offset `gathered`); GROUP items at a time.
    LAMPORT: the gathered copy is polled (symm_signal), so never store the empty pattern."""
    sub = tl.arange(0, SUB_BLOCK)
    owned = rank * SUB + sub
    for start in range(first, last, programs * GROUP):
        items, valid = item_group(start, last, programs, GROUP)
        index = items[:, None] * ITEM + owned[None, :]
        mask = valid[:, None] & ((sub < SUB) & (owned < ITEM))[None, :] & (index < numel)
        places = staging + items[:, None] * SUB + sub[None, :]
        total = tl.zeros([GROUP, SUB_BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(places + source * stage_stride, mask=mask, other=0.0).to(tl.float32)
        reduced = total.to(dtype)
        if LAMPORT:
            reduced = never_empty(reduced)
        push_to_peers(data_table, rank, gathered + index, reduced, mask, WORLD_SIZE)


@triton.jit
def finish_items(local, gathered, first, last, programs, numel, epilogue, OPS: tl.constexpr,
                 ITEM: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                 LAMPORT: tl.constexpr, PRELOAD: tl.constexpr, timeout_ns, rank,
                 ON_GPU: tl.constexpr):
    """Phase 3: the epilogue over whole items of the local gathered copy, GROUP at a time.
    LAMPORT: wait for the items by polling them, and empty them after reading; PRELOAD: the
    epilogue's operands are read before that wait (`take_with_operands`)."""
    column = tl.arange(0, BLOCK)[None, :]
    for start in range(first, last, programs * GROUP):
        items, valid = item_group(start, last, programs, GROUP)
        index = items[:, None] * ITEM + column
        mask = valid[:, None] & (column < ITEM) & (index < numel)
        if LAMPORT:
            y, operands = take_with_operands(local + gathered + index, mask, timeout_ns, rank,
                                             ON_GPU, index, column, mask, epilogue, OPS, PRELOAD)
        else:
            y = tl.load(local + gathered + index, mask=mask, other=0.0)
            operands = epilogue_operands(index, column, mask, epilogue, OPS, epilogue[6])
        finish_loaded(y.to(tl.float32), operands, index, column, mask, epilogue, OPS, ITEM)


# ---- host side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SymmTuning:
    """Launch knobs for experiments, passed to every launch (the engine passes its symm_*
    settings). They shape the launch, so every rank must pass the same. `timeout_s`: a wait past it traps the kernel. `group_items`, `round_items`: n > 0
    forces the two-shot items per step (`group_items`) and per round (two_shot_all_reduce's
    `round_items`); 0 picks by size. `preload`: the Lamport kernels read the epilogue's
    operands (residual, norm weight) before they poll for the peers' data, not after; off for
    comparisons (launch/bench_knobs.py). `fold_row_max`: a per-token quantizer after an RMSNorm
    takes the row max from the norm's reduction rather than reducing the row again (the same
    bits); off for comparisons. `pdl`: the all-reduce kernels launch with programmatic dependent
    launch where the GPU has it (`pdl_options`); off for comparisons."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    group_items: int = 0
    round_items: int = 0
    preload: bool = True
    fold_row_max: bool = True
    pdl: bool = True

    def __post_init__(self):
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")
        for name in ("group_items", "round_items"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("preload", "fold_row_max", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


DEFAULT_TUNING = SymmTuning()


# CUDA graphs capture a programmatic launch as such from CUDA 12.3 on.
PDL_CUDA = (12, 3)


@functools.cache
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@functools.cache
def _cuda_version() -> tuple:
    return tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])


def pdl_options(tuning: SymmTuning, tensor) -> dict:
    """A launch's options for programmatic dependent launch: the kernel may be launched while
    the kernel before it on the stream finishes (its wait is on the device, `gdc_wait`, before
    its first read), and it lets the next one launch early. On 2 GPUs, at 1-16 tokens, a call
    after a cuBLAS GEMM took about 0.9 µs less of its 3-4 µs (docs/notes_symm.md, session 24).
    Where `tuning.pdl`, `tensor` is on a GPU that has it (sm_90 on: griddepcontrol) and torch's
    CUDA is PDL_CUDA or later."""
    if not (tuning.pdl and tensor.is_cuda) or _cuda_version() < PDL_CUDA:
        return {}
    index = tensor.device.index
    if _major(torch.cuda.current_device() if index is None else index) < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


def group_items(items: int, grid: int, tuning: SymmTuning = DEFAULT_TUNING) -> int:
    """Items a program moves at once in each phase: more bytes in flight per program. One item
    (8 KiB of bf16 at hidden 4096) leaves the copy latency-bound; on 4 H200s, add_rms_norm
    x 4096 bf16 ran faster with 2 at 1024 tokens and with 4 at 8192 (8 at 8192 was slower
    again: registers; docs/notes_symm.md, session 2). tuning.group_items = n > 0 forces n, rounded
    up to a power of two."""
    if tuning.group_items > 0:
        return triton.next_power_of_2(tuning.group_items)
    per_program = triton.cdiv(items, grid)
    return 4 if per_program >= 16 else 2 if per_program >= 4 else 1
