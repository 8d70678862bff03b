"""GEMM + all-reduce through symmetric memory: the matmul that makes the partial sums, each
finished output tile pushed to every rank as it is made, then the one-shot reduction with the
epilogue fused.

Unfused torch equivalent (w [N, K] in F.linear's layout, or [K, N] without transpose_weight):
    y = F.linear(x, w, bias)                      # fp32 accumulator, rounded once to x.dtype
    y = prologue(y); dist.all_reduce(y)           # every op rounds to x.dtype
    out = epilogue(y)                             # chain, then optional (add_)rms_norm

Two launches, one after the other on one stream:
  1. `gemm_push_kernel`, each program making output tiles in turn (one per SM at prefill, one
     tile each at decode): the tile's GEMM (fp32 accumulator, the bias added in fp32, rounded
     to the dtype like the matmul's output; A and B through tensor descriptors where their
     layouts allow), the elementwise prologue on it, then stores into slot `rank` of every
     rank's buffer (symm_device's push_to_peers). No program waits for anything, so the
     transfers of finished tiles overlap the tiles still being computed, and the grid may be
     any size.
  2. `gemm_reduce_kernel`: the one-shot all-reduce's second half (symm_device.reduce_slots).
     Program b's block barrier pairs with program b of every peer, and a peer arrives there
     only once its launch 1 has finished, so every tile of every rank has landed; then the W
     slots are summed in rank order in fp32 and rounded once, and the epilogue (chain, norm,
     quantizer, symm_chain.finish_item) runs on whole rows.
The tiles and launch 2's grid come from shapes alone (launch 1's program count also from the
GPU's SM count, which only decides which program makes a tile), so every rank sums the same
values in the same order: bitwise identical outputs on every rank.

Reuse is the one-shot's: two halves at fixed offsets, picked by the call counter that launch 2
advances (launch 1 reads it), so call n+1 writes the other half. A peer writes this call's
half again only in call n+2, whose launch 1 runs after its call n+1 passed the barrier, which
this rank reaches only after finishing call n. Capped by the engine's adapter
(scheduler/backends/symm_gemm.py) like the one-shot kernels: every rank holds W copies.
"""

from __future__ import annotations

import functools
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


@triton.jit
def tile_at(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile `tile`'s (row, column) of tiles: groups of GROUP_M rows of tiles, column by column,
    so the programs running at once read the same columns of B while they are in L2."""
    per_group = GROUP_M * tiles_n
    first_m = tile // per_group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + tile % per_group % group_m, tile % per_group // group_m


@triton.jit
def tile_product(a, b, tile_m, tile_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 TMA: tl.constexpr, B_NK: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One output tile's fp32 sum over K. TMA: `a` and `b` are tensor descriptors (the copy
    engine fetches whole tiles, zero past every edge, so no masks and no index arithmetic);
    else pointers with any strides."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            x = a.load([tile_m * BLOCK_M, step * BLOCK_K])
            if B_NK:  # F.linear's [N, K]: the tile comes K-major, the dot takes it transposed
                w = b.load([tile_n * BLOCK_N, step * BLOCK_K]).T
            else:
                w = b.load([step * BLOCK_K, tile_n * BLOCK_N])
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        # Rows and columns past the end read rows and columns that exist (their results are
        # never stored), so only K needs masks, and none where BLOCK_K divides it.
        a_ptrs = (a + (rows % M).to(tl.int64)[:, None] * stride_am
                  + ks[None, :].to(tl.int64) * stride_ak)
        b_ptrs = (b + ks[:, None].to(tl.int64) * stride_bk
                  + (cols % N).to(tl.int64)[None, :] * stride_bn)
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                x = tl.load(a_ptrs)
                w = tl.load(b_ptrs)
            else:
                left = K - step * BLOCK_K
                x = tl.load(a_ptrs, mask=ks[None, :] < left, other=0.0)
                w = tl.load(b_ptrs, mask=ks[:, None] < left, other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["rank"])
def gemm_push_kernel(
        a_ptr, b_ptr, bias_ptr, prologue, data_table, epoch_ptr, M, N, K, stride_am, stride_ak,
        stride_bk, stride_bn, slot_stride, half_stride, rank, PROLOGUE: tl.constexpr,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, WORLD_SIZE: tl.constexpr, TMA: tl.constexpr, B_NK: tl.constexpr,
        FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # Persistent: program p makes tiles p, p + programs, ... (any grid size works), so the
    # descriptors are made once per program and, FLATTEN, the next tile's loads are issued
    # during this tile's push.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if TMA:  # in-kernel descriptors: arguments stay plain pointers, as FastLaunch binds them
        a = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_NK:
            b = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
    else:
        a = a_ptr
        b = b_ptr
    dtype = a_ptr.dtype.element_ty
    # Launch 2 advances every counter slot, so slot 0 holds this call's count.
    _, half = call_half(epoch_ptr, 0, half_stride)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0),
                         flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        tile_m, tile_n = tile_at(tile, tiles_m, tiles_n, GROUP_M)
        acc = tile_product(a, b, tile_m, tile_n, M, N, K, stride_am, stride_ak, stride_bk,
                           stride_bn, TMA, B_NK, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        index = rows.to(tl.int64)[:, None] * N + cols[None, :]
        y = apply_prologue(round_to(acc, dtype), index, mask, prologue, PROLOGUE, dtype)
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
    persistent: bool = False       # one program per SM looping over the tiles, else one a tile
    warp_specialize: bool = False  # Triton's producer / consumer warps (TMA layouts only)
    tma: bool = True               # tensor descriptors where the layouts allow them


def gemm_tiles(m: int, n: int, k: int, dtype: torch.dtype) -> GemmTiles:
    """Tile sizes from the shapes alone (the same on every rank; no per-rank autotuning), the
    best of launch/bench_gemm_tiles' sweeps on an H100 (docs/benchmarks.md). 16-bit prefill:
    128 x 256 tiles, persistent, tensor descriptors, warp-specialised. Decode (a row tile or
    two, the weight streamed once): narrow column tiles over 256-deep K steps through plain
    loads, which streamed it faster than descriptors did, and which spare the per-call scratch
    allocation that descriptors need. fp32 (ieee dot): the old small tiles; descriptors and
    bigger tiles measured slower there."""
    if dtype.itemsize == 4:
        if m <= 64:
            return GemmTiles(max(16, triton.next_power_of_2(m)), 64, 32, 1, 4, 4, tma=False)
        return GemmTiles(64, 64, 32, 8, 4, 3, tma=False)
    if m > 64:
        return GemmTiles(128, 256, 64, 8, 8, 3, persistent=True, warp_specialize=True)
    if m > 32:
        return GemmTiles(32, 64, 128, 1, 4, 4, tma=False)
    if m > 16:
        return GemmTiles(32, 32, 256, 1, 4, 4, tma=False)
    # One row (Triton then compiles M == 1 in) runs best with wider column tiles.
    return GemmTiles(16, 64 if m == 1 else 32, 256, 1, 4, 5, tma=False)


@functools.cache
def _processors(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: a few programs, each making several tiles
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def descriptor_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor meets the copy engine's rules: its rows contiguous, the row stride
    and the base address multiples of 16 bytes."""
    return (t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0
            and t.data_ptr() % 16 == 0)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def scratch_allocator() -> None:
    """In-kernel tensor descriptors live in global scratch that Triton asks its allocator for
    at every launch; its default refuses. Install torch's in this thread's context unless one is
    set (the setting is a context variable: each thread starts without one; Triton has no
    public getter for it)."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


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
                           tuning=DEFAULT_TUNING, tiles=None, **options):
    """The two launches, each (kernel, grid, args, kwargs). x: [M, K] (any strides), w: [N, K]
    with `transpose_weight` (F.linear's layout), else [K, N]; `matmul_bias` [N]; `out` and the
    other outputs are the [M, N] results; `tiles` replaces gemm_tiles' choice (benchmarks).
    Options as in symm_chain.fused_arguments (the prologue's sides are [M, N]; `bias` is the
    norm's, as there). Reads only shapes, strides, dtypes, devices and the 16-byte alignment of
    the tensors, so the engine binds it once with stand-ins (nt_runtime.FastLaunch) and
    rebinds where an alignment changes (symm_gemm.PreparedGemm)."""
    m, k = x.shape
    n = w.shape[0] if transpose_weight else w.shape[1]
    numel = m * n
    layout, (x_like, prologue, epilogue), kwargs = fused_arguments(
        carrier(buffer, x.dtype, numel), buffer, out, fold_row_max=tuning.fold_row_max,
        **options)
    tiles = tiles or gemm_tiles(m, n, k, x.dtype)
    tma = tiles.tma and descriptor_ready(x) and descriptor_ready(w)
    if tma and x.is_cuda:
        scratch_allocator()
    stride_bk, stride_bn = (w.stride(1), w.stride(0)) if transpose_weight else w.stride()
    slots, halves = slot_elements(numel), part_elements(buffer, x.element_size(), 2)
    programs = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    if tiles.persistent:
        programs = min(programs, _processors(x.device))
    gemm = (gemm_push_kernel, (programs,),
            (x, w, x if matmul_bias is None else matmul_bias, prologue, buffer.data_table,
             buffer.epoch, m, n, k, x.stride(0), x.stride(1), stride_bk, stride_bn, slots,
             halves, buffer.rank),
            dict(PROLOGUE=kwargs.pop("PROLOGUE"), HAS_BIAS=matmul_bias is not None,
                 EVEN_K=k % tiles.block_k == 0, PRECISION=matmul_precision(x.dtype),
                 BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                 GROUP_M=tiles.group_m, WORLD_SIZE=buffer.world_size, TMA=tma,
                 B_NK=transpose_weight, FLATTEN=tiles.persistent,
                 WARP_SPECIALIZE=tma and tiles.warp_specialize,
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
