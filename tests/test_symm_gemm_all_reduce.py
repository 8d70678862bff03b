"""kernels/gemm_all_reduce.py: interpreted on 2 and 3 CPU ranks (W processes whose "symmetric"
buffers are shared CPU memory, as tests/symm_runs.py runs the all-reduce kernels), through the
engine's algorithm (scheduler/backends/symm_gemm.py: its normal launch and its bound launches)
and as a plain callable; every output against the fp32 reference and bitwise equal across
ranks. Cases follow each other on one buffer, two calls each, so both halves and shape changes
are covered. On GPUs: tests/gpu_gemm_worker.py (fp32 reference, ranks identical, CUDA graphs).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import gemm_cases
from gemm_cases import PATTERNS, make_inputs, meta_of, widen_interpreted_bf16_dot
from multirank import SAFE_GPU_ENV, run_process
from symm_cases import digest, full_span, max_error, reference

F32, BF16 = torch.float32, torch.bfloat16


def _algorithm():
    from infini_dist.scheduler.choices import algorithms_for
    (found,) = [a for a in algorithms_for("all_reduce", "cuda") if a.name == "gemm_one_shot"]
    return found


def _callable(values, buffer, tuning):
    """linear_add_rms_norm through the kernel file's plain callable."""
    from infini_dist.kernels.gemm_all_reduce import gemm_all_reduce
    out, residual = gemm_all_reduce(values["x"], values["wm"], buffer=buffer, tuning=tuning,
                                    weight=values["w"], residual=values["res"], eps=1e-5)
    return {"n": out, "r": residual}


def interpreted_rank(rank, world_size, storage, cases):
    """Every case twice on one shared buffer: the algorithm's normal launch (call 0), its bound
    launches (call 1, symm_gemm.PreparedGemm), or the plain callable (both calls)."""
    import infini_dist
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    from infini_dist.scheduler.backends.symm_launch import tuning_of
    from infini_dist.scheduler.backends.symm_gemm import PreparedGemm, plan_gemm
    from infini_dist.scheduler.choices import RunContext
    widen_interpreted_bf16_dot()
    ctx = RunContext(None, world_size, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    tuning = tuning_of(ctx.settings)
    algorithm = _algorithm()
    buffer = from_peer_tensors(storage, rank)
    results = []
    for pattern, x_shape, n, dtype, by_callable in cases:
        graph = PATTERNS[pattern]
        plan = plan_gemm(full_span(graph), meta_of(graph, x_shape, n, dtype), ctx)
        assert plan is not None and algorithm.data_bytes(plan, world_size) <= buffer.data_bytes
        prepared = None
        for call in range(2):
            everyone = [make_inputs(graph, x_shape, n, dtype, r, call) for r in range(world_size)]
            mine = everyone[rank]
            if by_callable:
                got = _callable(mine, buffer, tuning)
            elif call == 0:
                got = algorithm.launch(plan, mine, buffer, tuning)
                prepared = PreparedGemm(algorithm, plan, buffer, mine, tuning, fast=True)
            else:
                got = prepared(mine)
            error = max_error(got, reference(graph, everyone, rank))
            results.append(((pattern, x_shape, str(dtype), by_callable, call), error,
                            digest(got)))
    return results


def run_interpreted(monkeypatch, world_size, cases):
    gemm_cases.run_interpreted(monkeypatch, interpreted_rank, world_size, cases, 1 << 20)


def test_interpreted_two_ranks(monkeypatch):
    run_interpreted(monkeypatch, 2, [
        ("linear_add_rms_norm", (2, 3, 40), 24, F32, False),   # x 3-D, K not a block multiple
        ("mm_bias_relu_scale", (5, 32), 40, F32, False),        # [K, N] weight, bias
        ("linear_train", (70, 16), 32, BF16, False),             # more rows than one tile
        # prefill tiles through descriptors of a [K, N] weight, 6 tiles over 3 persistent
        # programs (gemm_all_reduce._processors off the GPU), ragged in M and N
        ("mm_bias_relu_scale", (130, 32), 600, BF16, False),
        ("linear_add_rms_norm", (3, 40), 24, BF16, True)])       # the plain callable


def test_interpreted_three_ranks(monkeypatch):
    run_interpreted(monkeypatch, 3, [
        ("linear_silu_mul", (4, 24), 48, F32, False),            # a prologue op after the GEMM
        ("linear", (1, 130), 72, BF16, False),                   # decode: one row, odd K
        ("linear_add_rms_norm", (6, 64), 32, F32, True)])


def test_planning():
    """Which spans the algorithm takes: a matmul at the prologue's head, with the all-reduce
    kernels' own limits on what follows; nothing without a matmul, on CPU or above its cap."""
    from infini_dist.scheduler.backends.symm_gemm import MAX_BYTES
    from infini_dist.scheduler.choices import FusedSpan, RunContext
    from symm_cases import build, meta_of as ar_meta_of
    algorithm = _algorithm()
    cuda = RunContext(None, 2, 0, torch.device("cuda"))
    for pattern in PATTERNS:
        graph = PATTERNS[pattern]
        meta = meta_of(graph, (4, 32), 16, BF16)
        assert algorithm.supports(full_span(graph), meta, cuda), pattern
        assert not algorithm.supports(full_span(graph), meta_of(graph, (4, 32), 16, BF16, "cpu"),
                                      RunContext(None, 2, 0, torch.device("cpu")))
        assert not algorithm.supports(full_span(graph), meta, RunContext(
            None, 1, 0, torch.device("cuda")))  # one rank: nothing to reduce
    graph = PATTERNS["linear_add_rms_norm"]
    site = full_span(graph)
    meta = meta_of(graph, (4, 32), 16, BF16)
    assert not algorithm.supports(FusedSpan(graph, (), site.anchors, site.epilogue), meta, cuda)
    rows = MAX_BYTES // (16 * 2)
    assert algorithm.supports(site, meta_of(graph, (rows, 8), 16, BF16), cuda)
    assert not algorithm.supports(site, meta_of(graph, (rows + 1, 8), 16, BF16), cuda)
    plain = build("add_rms_norm")  # an all_reduce site without a matmul
    assert not algorithm.supports(full_span(plain), ar_meta_of(plain, (4, 16), BF16), cuda)


def test_bound_launches_keep_their_alignment():
    """The engine's bound launches fix the GEMM's tensor-descriptor choice, which needs x and w
    16-byte aligned: a later call whose x has the same shape and strides but another alignment
    must take the normal path (symm_gemm.PreparedGemm.usable), never the bound descriptors."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    from infini_dist.scheduler.backends.symm_gemm import PreparedGemm, plan_gemm
    from infini_dist.scheduler.backends.symm_launch import tuning_of
    from infini_dist.scheduler.choices import RunContext
    import infini_dist
    graph = PATTERNS["linear"]
    ctx = RunContext(None, 2, 0, torch.device("cuda"), settings=infini_dist.config.snapshot())
    plan = plan_gemm(full_span(graph), meta_of(graph, (96, 64), 32, BF16), ctx)
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 16), dtype=torch.uint8)
                                for _ in range(2)], 0)
    env = make_inputs(graph, (96, 64), 32, BF16, 0, 0)
    prepared = PreparedGemm(_algorithm(), plan, buffer, env, tuning_of(ctx.settings), fast=True)
    assert prepared.enabled
    wider = torch.randn(96 * 64 + 8).to(BF16)
    aligned, shifted = wider[:96 * 64].view(96, 64), wider[1:96 * 64 + 1].view(96, 64)
    assert aligned.data_ptr() % 16 == 0
    assert prepared.usable([aligned, env["wm"]])
    assert not prepared.usable([shifted, env["wm"]])


def compile_launches(m, k, n, dtype, transpose, matmul_bias, prologue, norm):
    """In the compile worker: both launches of one plain call bound on host tensors and compiled
    by Triton's CUDA backend (sm_90, kernel.warmup); the GEMM's shared memory in bytes."""
    from infini_dist.kernels.gemm_all_reduce import gemm_all_reduce_launch
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    from infini_dist.kernels.symm_call import chain_ops
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn((n, k) if transpose else (k, n), dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 24), dtype=torch.uint8)
                                for _ in range(2)], 0)
    sides = {}
    options = dict(prologue=chain_ops(prologue, out, sides), sides=sides)
    if norm:
        options.update(norm=1, weight=torch.ones(n, dtype=dtype), residual=torch.zeros_like(out),
                       row_len=n, pre=torch.empty_like(out))
    shared = 0
    for kernel, grid, args, kwargs in gemm_all_reduce_launch(
            x, w, buffer, out, matmul_bias=torch.zeros(n, dtype=dtype) if matmul_bias else None,
            transpose_weight=transpose, **options):
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        shared = max(shared, int(getattr(compiled.metadata, "shared", 0) or 0))
    return shared


def test_kernels_compile_for_sm90(tmp_path):
    """The GEMM and reduce launches through Triton's GPU compiler on the CPU (the interpreter
    above compiles nothing): decode and prefill tiles, bf16 / fp16 / fp32 (ieee dot), both
    weight layouts, bias, a prologue op, a residual + RMSNorm epilogue."""
    pytest.importorskip("triton.backends.nvidia")
    from launch_stub import compile_pool
    cases = [(4, 256, 512, BF16, True, True, (("silu",),), True),        # decode tiles
             (256, 512, 512, BF16, True, False, (), True),               # prefill tiles
             (100, 96, 64, torch.float16, False, True, (("relu",),), False),
             (80, 64, 48, F32, True, False, (), True)]
    with compile_pool(str(tmp_path / "home")) as pool:
        shared = [pool.submit(compile_launches, *case).result(timeout=600) for case in cases]
    # The prefill tiles' stages (128 x 256 x 64 bf16, 3 deep: 144 KiB) and the epilogue's
    # layout change fit the 227 KiB an H100 gives one block.
    assert 0 < shared[1] <= 227 * 1024, shared


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    gpus = torch.cuda.device_count()
    env = dict(os.environ, **SAFE_GPU_ENV, INFINI_DIST_CACHE_DIR=str(tmp_path / "cache"))
    worker = os.path.join(os.path.dirname(__file__), "gpu_gemm_worker.py")
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={min(gpus, 4)}", worker], env=env, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ALL OK" in done.stdout
