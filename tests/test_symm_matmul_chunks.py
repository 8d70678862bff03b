"""scheduler/backends/symm_chunked.py and kernels/chunk_reduce.py: the matmul in chunks of rows,
each chunk copied into the peers' slots, then reduced with the epilogue. Interpreted on 2 and 3
CPU ranks (shared CPU memory as the symmetric buffers, as tests/symm_runs.py runs the kernels;
plain copies and no streams off the GPU), every output against the fp32 reference and bitwise
equal across ranks; on GPUs, with the copy engine on a side stream: tests/gpu_gemm_worker.py
--chunks."""

from __future__ import annotations

import pytest
import torch

import gemm_cases
from gemm_cases import PATTERNS, make_inputs, meta_of
from multirank import run_ranks
from symm_cases import digest, full_span, max_error, reference

F32, BF16 = torch.float32, torch.bfloat16


def interpreted_rank(rank, world_size, storage, cases):
    """Each case twice, every case on one shared buffer (its slots are reused from call to call
    and across shapes), through a MatmulChunks of `chunks` chunks of any size."""
    import infini_dist
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    from infini_dist.scheduler.backends.symm_chunked import MatmulChunks
    from infini_dist.scheduler.choices import RunContext
    ctx = RunContext(None, world_size, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    buffer = from_peer_tensors(storage, rank)
    results = []
    for pattern, x_shape, n, dtype, chunks in cases:
        graph = PATTERNS[pattern]
        algorithm = MatmulChunks(chunks, min_chunk_rows=1)
        plan = algorithm.plan(full_span(graph), meta_of(graph, x_shape, n, dtype), ctx)
        assert plan is not None and algorithm.data_bytes(plan, world_size) <= buffer.data_bytes
        for call in range(2):
            everyone = [make_inputs(graph, x_shape, n, dtype, r, call) for r in range(world_size)]
            got = algorithm.launch(plan, everyone[rank], buffer)
            error = max_error(got, reference(graph, everyone, rank))
            results.append(((pattern, x_shape, str(dtype), chunks, call), error, digest(got)))
    return results


def run_interpreted(monkeypatch, world_size, cases):
    gemm_cases.run_interpreted(monkeypatch, interpreted_rank, world_size, cases, 1 << 17)


def test_interpreted_two_ranks(monkeypatch):
    run_interpreted(monkeypatch, 2, [
        ("linear_add_rms_norm", (2, 5, 24), 16, F32, 3),  # x 3-D, chunks of 4, 3 and 3 rows
        ("mm_bias_relu_scale", (7, 32), 40, F32, 2),      # [K, N] weight with a bias, no norm
        ("linear_train", (9, 16), 32, F32, 4)])           # rsqrt and the all_reduce's value


def test_interpreted_three_ranks(monkeypatch):
    run_interpreted(monkeypatch, 3, [
        ("linear_mul", (6, 24), 48, F32, 2),              # a row side after the all_reduce
        ("linear_add_rms_norm", (5, 8), 16, BF16, 2)])


def test_planning():
    """The splits take matmul spans of at least 128 rows a chunk, with nothing between the
    matmul and the all_reduce, up to their cap; nothing on CPU, below the rows, or without a
    matmul."""
    from infini_dist.scheduler.backends.symm_chunked import (MAX_BYTES, MIN_CHUNK_ROWS,
                                                              algorithms, chunk_bounds)
    from infini_dist.scheduler.choices import RunContext
    from symm_cases import build, meta_of as ar_meta_of
    found = {a.name: a for a in algorithms()}
    assert sorted(found) == ["matmul_ce_chunks2"]
    cuda = RunContext(None, 2, 0, torch.device("cuda"))
    graph = PATTERNS["linear_add_rms_norm"]
    for name, algorithm in found.items():
        rows = algorithm.chunks * MIN_CHUNK_ROWS
        assert algorithm.supports(full_span(graph), meta_of(graph, (rows, 32), 16, BF16), cuda)
        assert not algorithm.supports(full_span(graph), meta_of(graph, (rows - 1, 32), 16, BF16),
                                      cuda), name
        assert not algorithm.supports(full_span(graph), meta_of(graph, (rows, 32), 16, BF16, "cpu"),
                                      RunContext(None, 2, 0, torch.device("cpu")))
        silu = PATTERNS["linear_silu_mul"]  # an op between the matmul and the all_reduce
        assert not algorithm.supports(full_span(silu), meta_of(silu, (rows, 32), 16, BF16), cuda)
        too_big = MAX_BYTES // 2 // 4096 + 1  # rows of 4096 bf16 just over the cap
        assert not algorithm.supports(full_span(graph), meta_of(graph, (too_big, 32), 4096, BF16),
                                      cuda)
    plain = build("add_rms_norm")  # an all_reduce site without a matmul
    assert not found["matmul_ce_chunks2"].supports(full_span(plain),
                                                   ar_meta_of(plain, (512, 16), BF16), cuda)
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(8, 2) == [(0, 4), (4, 8)]


def _warm_up_rank(rank, world_size):
    """Each split's compile-time warm-up launch, as symm_launch.warm_up makes it, on the
    warm-up's scratch (every 'peer' this rank's own memory, every barrier already met)."""
    from infini_dist.kernels.symm_buffers import local_scratch
    from infini_dist.scheduler.backends.symm_chunked import MatmulChunks, algorithms
    from infini_dist.scheduler.choices import RunContext
    graph = PATTERNS["linear_add_rms_norm"]
    ctx = RunContext(None, 2, 0, torch.device("cuda"))
    done = []
    for algorithm in algorithms() + [MatmulChunks(4)]:
        algorithm.min_chunk_rows = 1
        rows = 2 * algorithm.chunks
        plan = algorithm.plan(full_span(graph), meta_of(graph, (rows, 16), 32, BF16), ctx)
        scratch = local_scratch(2, 0, algorithm.data_bytes(plan, 2), "cpu")
        for call in range(3):  # calls after the first find the barriers' flags still raised
            out = algorithm.launch(plan, make_inputs(graph, (rows, 16), 32, BF16, 0, call),
                                   scratch)
        done.append((algorithm.name, tuple(out["n"].shape)))
    return done


def test_the_warm_up_runs_every_split_alone():
    # the compile step's warm-up has no peer: a barrier waiting on one would hang the compile
    (done,) = run_ranks(_warm_up_rank, 1, timeout=240, env={"TRITON_INTERPRET": "1"})
    assert done == [("matmul_ce_chunks2", (4, 32)), ("matmul_ce_chunks4", (8, 32))]


def test_a_chunk_reduce_takes_no_prologue():
    from infini_dist.kernels.chunk_reduce import chunk_reduce_launches
    from infini_dist.kernels.symm_buffers import local_scratch
    from infini_dist.kernels.symm_chain import ChainOp
    y = torch.randn(4, 8)
    with pytest.raises(ValueError, match="no prologue"):
        chunk_reduce_launches(y, local_scratch(2, 0, 1024, "cpu"), torch.empty_like(y),
                              [(0, 32)], prologue=(ChainOp(1),))
