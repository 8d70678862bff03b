"""scheduler/backends/symm_chunked.py: the matmul in chunks of rows, each chunk's all-reduce and
epilogue by the streamed Lamport kernel. Interpreted on 2 and 3 CPU ranks (shared CPU memory as
the symmetric buffers, as tests/symm_runs.py runs the kernels; no streams off the GPU), every
output against the fp32 reference and bitwise equal across ranks; on GPUs with a side stream:
tests/gpu_gemm_worker.py."""

from __future__ import annotations

import pytest
import torch

from gemm_cases import PATTERNS, check_rank_results, make_inputs, meta_of
from multirank import run_ranks
from symm_cases import digest, full_span, max_error, reference

F32, BF16 = torch.float32, torch.bfloat16


def interpreted_rank(rank, world_size, storage, cases):
    """Each case twice on one shared buffer (both Lamport halves), through a MatmulChunks of
    `chunks` chunks on at most `programs` programs, chunks of any size."""
    import infini_dist
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    from infini_dist.scheduler.backends.symm_chunked import MatmulChunks
    from infini_dist.scheduler.backends.symm_launch import tuning_of
    from infini_dist.scheduler.choices import RunContext
    ctx = RunContext(None, world_size, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    buffer = from_peer_tensors(storage, rank)
    results = []
    for pattern, x_shape, n, dtype, chunks, programs in cases:
        graph = PATTERNS[pattern]
        algorithm = MatmulChunks(chunks, programs, min_chunk_rows=1)
        plan = algorithm.plan(full_span(graph), meta_of(graph, x_shape, n, dtype), ctx)
        assert plan is not None and algorithm.data_bytes(plan, world_size) <= buffer.data_bytes
        for call in range(2):
            everyone = [make_inputs(graph, x_shape, n, dtype, r, call) for r in range(world_size)]
            got = algorithm.launch(plan, everyone[rank], buffer, tuning_of(ctx.settings))
            error = max_error(got, reference(graph, everyone, rank))
            results.append(((pattern, x_shape, str(dtype), chunks, call), error, digest(got)))
    return results


def run_interpreted(monkeypatch, world_size, cases):
    from infini_dist.kernels.symm_buffers import fill_empty, header_bytes
    from infini_dist.scheduler.backends.symm_chunked import REDUCTION
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # spawned ranks inherit it before importing triton
    (width,) = {REDUCTION.lamport_width(dtype) for *_, dtype, _, _ in cases}  # one buffer
    storage = [torch.zeros(header_bytes(world_size) + (1 << 18), dtype=torch.uint8)
               .share_memory_() for _ in range(world_size)]
    for s in storage:
        fill_empty(s, world_size, width)
    per_rank = run_ranks(interpreted_rank, world_size, storage, cases, timeout=300,
                         env={"TRITON_INTERPRET": "1"})
    check_rank_results(per_rank)


def test_interpreted_two_ranks(monkeypatch):
    run_interpreted(monkeypatch, 2, [
        ("linear_add_rms_norm", (2, 5, 24), 16, F32, 3, 2),  # x 3-D, chunks of 4, 3 and 3 rows
        ("mm_bias_relu_scale", (7, 32), 40, F32, 2, 128),    # [K, N] weight with a bias
        ("linear_train", (9, 16), 32, F32, 4, 1)])           # rsqrt and reduced value, 1 program


def test_interpreted_three_ranks(monkeypatch):
    run_interpreted(monkeypatch, 3, [
        ("linear_silu_mul", (6, 24), 48, F32, 2, 2)])        # a prologue op and a row side


def test_planning():
    """The splits take matmul spans of at least 128 rows a chunk, within the streamed kernel's
    limits; nothing on CPU, below the rows, or without a matmul."""
    from infini_dist.scheduler.backends.symm_chunked import (MIN_CHUNK_ROWS, algorithms,
                                                              chunk_bounds)
    from infini_dist.scheduler.choices import RunContext
    from symm_cases import build, meta_of as ar_meta_of
    found = {a.name: a for a in algorithms()}
    assert sorted(found) == ["matmul_chunks2_p32", "matmul_chunks4_p128", "matmul_chunks4_p32"]
    cuda = RunContext(None, 2, 0, torch.device("cuda"))
    graph = PATTERNS["linear_add_rms_norm"]
    for name, algorithm in found.items():
        rows = algorithm.chunks * MIN_CHUNK_ROWS
        assert algorithm.supports(full_span(graph), meta_of(graph, (rows, 32), 16, BF16), cuda)
        assert not algorithm.supports(full_span(graph), meta_of(graph, (rows - 1, 32), 16, BF16),
                                      cuda), name
        assert not algorithm.supports(full_span(graph), meta_of(graph, (rows, 32), 16, BF16, "cpu"),
                                      RunContext(None, 2, 0, torch.device("cpu")))
    plain = build("add_rms_norm")  # an all_reduce site without a matmul
    assert not found["matmul_chunks2_p32"].supports(full_span(plain),
                                                    ar_meta_of(plain, (512, 16), BF16), cuda)
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(8, 2) == [(0, 4), (4, 8)]


@pytest.mark.parametrize("shape, per_row", [((6, 4), True), ((4,), False), ((), False),
                                            ((1, 4), False), ((6, 1), None), ((3, 4), None)])
def test_operands_slice_with_the_rows_or_stay_whole(shape, per_row):
    from infini_dist.scheduler.backends.symm_chunked import _per_row
    assert _per_row(shape, (6, 4)) is per_row


def _warm_up_rank(rank, world_size):
    """Each split's compile-time warm-up launch, as symm_launch.warm_up makes it, on the
    warm-up's scratch (every 'peer' this rank's own memory, zeroed: nothing refills a place
    a poll empties)."""
    from infini_dist.kernels.symm_buffers import local_scratch
    from infini_dist.scheduler.backends.symm_chunked import algorithms
    from infini_dist.scheduler.choices import RunContext
    graph = PATTERNS["linear_add_rms_norm"]
    ctx = RunContext(None, 2, 0, torch.device("cuda"))
    done = []
    for algorithm in algorithms():
        split, rows = algorithm.warm_up_split(), 2 * algorithm.chunks
        plan = split.plan(full_span(graph), meta_of(graph, (rows, 16), 32, BF16), ctx)
        scratch = local_scratch(2, 0, split.data_bytes(plan, 2), "cpu")
        split.launch(plan, make_inputs(graph, (rows, 16), 32, BF16, 0, 0), scratch)
        done.append((algorithm.name, split.chunks))
    return done


def test_the_warm_up_launches_at_most_two_chunks(monkeypatch):
    # Four chunks on the warm-up's scratch: the third polls the places the first emptied and
    # waits for ever (on 2 H100s: a trap at the symmetric-memory timeout, session 19).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (done,) = run_ranks(_warm_up_rank, 1, timeout=240, env={"TRITON_INTERPRET": "1"})
    assert done == [("matmul_chunks2_p32", 2), ("matmul_chunks4_p32", 2),
                    ("matmul_chunks4_p128", 2)]
