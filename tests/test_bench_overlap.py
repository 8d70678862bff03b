"""launch/bench_overlap.py, the overlap probe, on CPU: its GEMMs are the TP decoder's shapes at
TP = 2 and 4 (the forward ones produce the all-reduce's tokens x hidden), and a GEMM in row
chunks computes what the whole GEMM does."""

from __future__ import annotations

import pytest
import torch

from infini_dist.launch import bench_overlap

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("world", [2, 4])
def test_gemm_shapes(world):
    tokens = 8
    shapes = {name: (a @ b).shape for name, (a, b) in
              bench_overlap.gemms(tokens, world, "cpu").items()}
    assert shapes["down (fwd)"] == shapes["o_proj (fwd)"] == (tokens, bench_overlap.HIDDEN)
    assert shapes["dW gate_up"] == (2 * bench_overlap.MLP // world, bench_overlap.HIDDEN)
    qkv = (bench_overlap.HEADS + 2 * bench_overlap.KV_HEADS) * bench_overlap.HEAD_DIM // world
    assert shapes["dW qkv"] == (qkv, bench_overlap.HIDDEN)


@pytest.mark.parametrize("rows,chunks", [(8, 2), (7, 4), (3, 4)])
def test_row_chunks_compute_the_whole_gemm(rows, chunks):
    a = torch.randn(rows, 48, dtype=torch.float64)
    b = torch.randn(48, 24, dtype=torch.float64)
    out, run = bench_overlap.in_chunks(a, b, chunks)
    run()
    torch.testing.assert_close(out, a @ b)
