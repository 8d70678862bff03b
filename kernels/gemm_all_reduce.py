"""GEMM + all-reduce through symmetric memory: the matmul that makes the partial sums, each
finished output tile pushed to every rank as it is made, then the one-shot reduction with the
epilogue fused.

Unfused torch equivalent (w [N, K] in F.linear's layout, or [K, N] without transpose_weight):
    y = F.linear(x, w, bias)                      # fp32 accumulator, rounded once to x.dtype
    y = prologue(y); dist.all_reduce(y)           # every op rounds to x.dtype
    out = epilogue(y)                             # chain, then optional (add_)rms_norm

Two launches, one after the other on one stream:
  1. `gemm_push_kernel`, one program per output tile: the tile's GEMM (fp32 accumulator, the
     bias added in fp32, rounded to the dtype like the matmul's output), the elementwise
     prologue on it, then stores into slot `rank` of every rank's buffer (symm_device's
     push_to_peers). No program waits for anything, so the transfers of finished tiles overlap
     the tiles still being computed, and the grid may be any size.
  2. `gemm_reduce_kernel`: the one-shot all-reduce's second half (symm_device.reduce_slots).
     Program b's block barrier pairs with program b of every peer, and a peer arrives there
     only once its launch 1 has finished, so every tile of every rank has landed; then the W
     slots are summed in rank order in fp32 and rounded once, and the epilogue (chain, norm,
     quantizer, symm_chain.finish_item) runs on whole rows.
Both grids come from shapes alone, so every rank launches the same ones, and every rank sums
the same values in the same order: bitwise identical outputs on every rank.

Reuse is the one-shot's: two halves at fixed offsets, picked by the call counter that launch 2
advances (launch 1 reads it), so call n+1 writes the other half. A peer writes this call's
half again only in call n+2, whose launch 1 runs after its call n+1 passed the barrier, which
this rank reaches only after finishing call n. Capped by the engine's adapter
(scheduler/backends/symm_gemm.py) like the one-shot kernels: every rank holds W copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infini_dist.kernels.one_shot_all_reduce import one_shot_bytes
from infini_dist.kernels.symm_buffers import part_elements, slot_elements
from infini_dist.kernels.symm_call import (call_buffer, call_outputs, chain_ops, checked_input,
                                           norm_options, quant_options, world_size_of)
from infini_dist.kernels.symm_chain import MAX_PROGRAMS, fused_arguments, round_to
from infini_dist.kernels.symm_device import (DEFAULT_TUNING, apply_prologue, call_half,
                                             program_items, push_to_peers, reduce_slots)


@triton.jit(do_not_specialize=["rank"])
def gemm_push_kernel(
        a_ptr, b_ptr, bias_ptr, prologue, data_table, epoch_ptr, M, N, K, stride_am, stride_ak,
        stride_bk, stride_bn, slot_stride, half_stride, rank, PROLOGUE: tl.constexpr,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, WORLD_SIZE: tl.constexpr):
    # Tiles in groups of GROUP_M rows of tiles, column by column: a group reads the same
    # columns of B while they are in L2.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    tile_m = first_m + pid % per_group % group_m
    tile_n = pid % per_group // group_m
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the end read rows and columns that exist (their results are never
    # stored), so only K needs masks, and none where BLOCK_K divides it.
    a_ptrs = (a_ptr + (rows % M).to(tl.int64)[:, None] * stride_am
              + ks[None, :].to(tl.int64) * stride_ak)
    b_ptrs = (b_ptr + ks[:, None].to(tl.int64) * stride_bk
              + (cols % N).to(tl.int64)[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = K - step * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    dtype = a_ptr.dtype.element_ty
    index = rows.to(tl.int64)[:, None] * N + cols[None, :]
    y = apply_prologue(round_to(acc, dtype), index, mask, prologue, PROLOGUE, dtype)
    # Launch 2 advances every counter slot, so slot 0 holds this call's count.
    _, half = call_half(epoch_ptr, 0, half_stride)
    push_to_peers(data_table, rank, half + rank * slot_stride + index, y.to(dtype), mask,
                  WORLD_SIZE)


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def gemm_reduce_kernel(
        x_ptr, epilogue, data_table, signal_table, epoch_ptr, numel, slot_stride, half_stride,
        rank, timeout_ns, EPILOGUE: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr,
        MAX_PROGRAMS: tl.constexpr, WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr,
        ON_GPU: tl.constexpr):
    pid, programs, first_item, items = program_items(numel, ITEM)
    calls, half = call_half(epoch_ptr, pid, half_stride)
    reduce_slots(x_ptr, epilogue, data_table, signal_table, epoch_ptr, calls, half, pid,
                 programs, first_item, items, numel, slot_stride, rank, timeout_ns, EPILOGUE,
                 ITEM, BLOCK, MAX_PROGRAMS, WORLD_SIZE, WS_P2, ON_GPU)


# ---- host side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def gemm_tiles(m: int, n: int, k: int, dtype: torch.dtype) -> GemmTiles:
    """Tile sizes from the shapes alone (the same on every rank; no per-rank autotuning): the
    usual Hopper shapes for 16-bit prefill, one narrow row tile and more column tiles for
    decode's few rows, and half-size tiles for fp32 (twice the shared memory per element). Not
    tuned on GPUs yet."""
    if m <= 64:  # decode: one row tile; more column tiles keep more SMs reading the weight
        return GemmTiles(max(16, triton.next_power_of_2(m)), 64, 128 if dtype.itemsize < 4
                         else 32, 1, 4, 4)
    if dtype.itemsize < 4:
        return GemmTiles(128, 128, 64, 8, 8, 3)
    return GemmTiles(64, 64, 32, 8, 4, 3)


def matmul_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 GEMMs as exact as torch's at its matmul precision
    ('highest', the default, is ieee; 'high' or 'medium' allow tf32, as cuBLAS then uses)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def gemm_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Data bytes one call needs: the one-shot's (two halves of W slots of the output)."""
    return one_shot_bytes(numel, element_size, world_size)


def carrier(buffer, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A tensor of `dtype` and `numel` elements over the buffer's own memory, which launch 2
    takes where the one-shot kernel takes its input: for the element type, the size and the
    unused pointer slots. Never read or written through."""
    return buffer.storage[:numel * dtype.itemsize].view(dtype)


def gemm_all_reduce_launch(x, w, buffer, out, *, matmul_bias=None, transpose_weight=True,
                           tuning=DEFAULT_TUNING, **options):
    """The two launches, each (kernel, grid, args, kwargs). x: [M, K] (any strides), w: [N, K]
    with `transpose_weight` (F.linear's layout), else [K, N]; `matmul_bias` [N]; `out` and the
    other outputs are the [M, N] results. Options as in symm_chain.fused_arguments (the
    prologue's sides are [M, N]; `bias` is the norm's, as there). Reads only shapes, strides,
    dtypes and devices of the tensors, so the engine binds it once with stand-ins
    (nt_runtime.FastLaunch)."""
    m, k = x.shape
    n = w.shape[0] if transpose_weight else w.shape[1]
    numel = m * n
    layout, (x_like, prologue, epilogue), kwargs = fused_arguments(
        carrier(buffer, x.dtype, numel), buffer, out, **options)
    tiles = gemm_tiles(m, n, k, x.dtype)
    stride_bk, stride_bn = (w.stride(1), w.stride(0)) if transpose_weight else w.stride()
    slots, halves = slot_elements(numel), part_elements(buffer, x.element_size(), 2)
    gemm = (gemm_push_kernel,
            (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),),
            (x, w, x if matmul_bias is None else matmul_bias, prologue, buffer.data_table,
             buffer.epoch, m, n, k, x.stride(0), x.stride(1), stride_bk, stride_bn, slots,
             halves, buffer.rank),
            dict(PROLOGUE=kwargs.pop("PROLOGUE"), HAS_BIAS=matmul_bias is not None,
                 EVEN_K=k % tiles.block_k == 0, PRECISION=matmul_precision(x.dtype),
                 BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                 GROUP_M=tiles.group_m, WORLD_SIZE=buffer.world_size,
                 num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    reduce = (gemm_reduce_kernel, (layout.grid,),
              (x_like, epilogue, buffer.data_table, buffer.signal_table, buffer.epoch, numel,
               slots, halves, buffer.rank, tuning.timeout_ns),
              dict(kwargs, MAX_PROGRAMS=MAX_PROGRAMS))
    return gemm, reduce


KIND = "gemm_one_shot"  # its buffers' key: launches of other protocols never share them


def gemm_all_reduce(x, w, *, group=None, matmul_bias=None, transpose_weight=True, prologue=(),
                    epilogue=(), weight=None, residual=None, eps=1e-6, norm="rms_norm",
                    bias=None, quant=None, buffer=None, tuning=DEFAULT_TUNING):
    """F.linear(x, w, matmul_bias) summed over `group`, the GEMM overlapped with the transfers
    and the prologue and epilogue fused: two launches. Collective: every rank of `group` calls
    it with the same shapes, dtypes and steps. x [..., K]; w [N, K] (F.linear's layout), or
    [K, N] with transpose_weight=False; matmul_bias [N]. Unfused torch equivalent (every step
    computes in fp32 and rounds to x.dtype):

        y = F.linear(x, w, matmul_bias)          # x @ w (+ matmul_bias), transpose_weight=False
        for step in prologue: y = step(y)        # side tensors: [..., N]
        dist.all_reduce(y, group=group)
        ... then as symm_call.SymmKernel.__call__: the epilogue, the norm a `weight` selects
        (`bias`: the norm's, layer_norm), the residual, the quantizer

    Returns out[, scales][, residual] like SymmKernel. `buffer`: a symm_buffers.SymmBuffer
    (default: this kernel's cached symmetric buffer of `group`, allocated on the first call)."""
    x = checked_input(x)
    if w.dim() != 2 or w.dtype != x.dtype or w.shape[1 if transpose_weight else 0] != x.shape[-1]:
        raise ValueError(f"w must be a {x.dtype} matrix whose K matches x's last dim "
                         f"({x.shape[-1]}), got {tuple(w.shape)} {w.dtype}")
    n = w.shape[0] if transpose_weight else w.shape[1]
    if matmul_bias is not None and (matmul_bias.shape != (n,) or matmul_bias.dtype != x.dtype):
        raise ValueError(f"matmul_bias must be a {x.dtype} vector of {n}, got "
                         f"{tuple(matmul_bias.shape)}")
    # empty_like of this expanded (overlapping) tensor is a fresh contiguous one of its shape
    like = x.new_empty(()).expand(tuple(x.shape[:-1]) + (n,))
    sides = {}
    options = dict(prologue=chain_ops(prologue, like, sides),
                   epilogue=chain_ops(epilogue, like, sides), sides=sides, eps=float(eps),
                   **norm_options(like, norm, weight, bias, residual), **quant_options(quant))
    size = gemm_bytes(like.numel(), x.element_size(), world_size_of(group, buffer))
    buffer = call_buffer(buffer, group, x.device, KIND, size)
    out, scales, pre = call_outputs(like, quant, residual)
    for kernel, grid, args, kwargs in gemm_all_reduce_launch(
            x.reshape(-1, x.shape[-1]), w, buffer, out, matmul_bias=matmul_bias,
            transpose_weight=transpose_weight, pre=pre, scales=scales, tuning=tuning, **options):
        kernel[grid](*args, **kwargs)
    results = tuple(t for t in (out, scales, pre) if t is not None)
    return results if len(results) > 1 else results[0]
