"""The Triton GEMM of kernels/gemm_all_reduce (launch 1: the tiles and their push into the
symmetric buffer) against cuBLAS `F.linear`, over tile configurations, on one GPU:

    python -m infini_dist.launch.bench_gemm_tiles

bf16, µs per call from CUDA-graph replays of 10 calls (triton.testing.do_bench's median). The
buffer is local scratch (symm_buffers.local_scratch): the push lands in this GPU's own memory,
so one GPU measures the GEMM and its stores. One line per shape: cuBLAS, every configuration
(GemmTiles' fields; tensor descriptors wherever the layouts allow), the best one and
`gemm_tiles`' default.
"""

from __future__ import annotations

from dataclasses import astuple

import torch
import torch.nn.functional as F
import triton

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.gemm_all_reduce import (GemmTiles, gemm_all_reduce_launch, gemm_bytes,
                                                 gemm_tiles)

SHAPES = ((1, 2048, 4096), (16, 2048, 4096), (32, 7168, 4096), (2048, 2048, 4096),
          (2048, 7168, 4096), (8192, 7168, 4096))  # M x K -> N: the TP=2 decoder's projections
# GemmTiles: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, persistent,
# warp_specialize, tma). The first of each list is the kernel before descriptors (pointer loads,
# one program a tile).
Y, N = True, False
PREFILL = ((128, 128, 64, 8, 8, 3, N, N, N), (128, 256, 64, 8, 8, 3, N, N, Y),
           (128, 256, 64, 8, 8, 3, Y, N, Y), (128, 256, 64, 8, 8, 4, Y, N, Y),
           (128, 256, 64, 8, 8, 3, Y, Y, Y), (128, 256, 64, 16, 8, 3, Y, Y, Y),
           (256, 128, 64, 8, 8, 3, Y, Y, Y), (128, 128, 64, 8, 8, 4, Y, Y, Y))
DECODE = ((16, 64, 128, 1, 4, 4, N, N, N), (16, 64, 256, 1, 4, 5, N, N, N),
          (16, 32, 256, 1, 4, 5, N, N, N), (16, 32, 256, 1, 4, 3, N, N, N),
          (16, 32, 128, 1, 2, 6, N, N, N), (32, 32, 256, 1, 4, 4, N, N, N),
          (16, 64, 256, 1, 4, 4, N, N, Y), (16, 32, 256, 1, 4, 4, N, N, Y))


def graph_us(fn, calls: int = 10) -> float:
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch advises
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100,
                                   return_mode="median") / calls * 1e3


def main() -> None:
    print(torch.cuda.get_device_name())
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        buffer = symm_buffers.local_scratch(1, 0, gemm_bytes(m * n, 2, 1), x.device)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cublas = graph_us(lambda: F.linear(x, w))
        row, best = [f"{m}x{k}->{n}", f"cuBLAS {cublas:.1f}"], None
        for config in PREFILL if m > 64 else DECODE:
            (kernel, grid, args, kwargs), _ = gemm_all_reduce_launch(
                x, w, buffer, out, tiles=GemmTiles(*config))
            try:
                us = graph_us(lambda: kernel[grid](*args, **kwargs))
            except Exception as error:  # noqa: BLE001 - a config that does not fit: reported
                row.append(f"{config}: {type(error).__name__}")
                continue
            row.append(f"{config}: {us:.1f}")
            if best is None or us < best[1]:
                best = (config, us)
        default = astuple(gemm_tiles(m, n, k, x.dtype))
        row.append(f"BEST {best[0]} {best[1]:.1f} us = {cublas / best[1]:.2f}x cuBLAS; "
                   f"default {default}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
