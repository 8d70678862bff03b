"""kernels/one_shot_scatter_gather: its plain callable on Triton-interpreted CPU ranks whose
"symmetric" buffers are shared memory (and on 2 GPUs over NCCL), against the float64 unfused
reference, bitwise equal on every rank and to reduce_scatter_all_gather's gathered value and
residual, shapes changing from call to call on one buffer while the last rank comes late to
every read (the two halves' reuse); and the spans the engine offers it for. Its engine algorithm
runs beside symm_scatter_gather's, and its callable's refusals are checked beside
reduce_scatter_all_gather's, in tests/test_symm_reduce_scatter_all_gather.py."""

from __future__ import annotations

import pytest
import torch

from infini_dist.scheduler.choices import FusedSpan, RunContext
from multirank import run_ranks
from symm_cases import digest, max_error
from test_symm_reduce_scatter_all_gather import (CALLABLE_EPS, _callable_inputs,
                                                 _callable_reference, _graph, _meta,
                                                 shared_storages)

F32, BF16 = torch.float32, torch.bfloat16
CHAIN = (("scale", 0.5), ("silu",))
# (shard shape, dtype, epilogue): x is [W * shard[0], ...] on every rank; "norm": residual add
# + RMSNorm, "chain": CHAIN without a norm. One row per shard, then longer rows: a peer one
# call ahead writes places the late rank's previous call read, but for the other half.
CASES = [((3, 40), F32, "norm"), ((1, 40), F32, "norm"), ((1, 96), F32, "norm"),
         ((2, 64), BF16, "norm"), ((2, 3, 16), F32, "norm"), ((3, 40), F32, "chain"),
         ((50, 8), F32, "norm")]  # more of x's rows than programs at 3 ranks
GPU_CASES = CASES + [((130, 8), BF16, "norm"), ((64, 4096), BF16, "norm"),
                     ((5, 1000), F32, "norm"), ((4, 4096), BF16, "chain")]


def _chain_reference(xs, world):
    """CHAIN on the sum in float64, each step rounded to the dtype as the kernels round it."""
    dtype = xs[0].dtype
    y = sum(x.double() for x in xs).to(dtype)
    y = (y.double() * 0.5).to(dtype).double()
    return (y * torch.sigmoid(y)).to(dtype)


def _late(module, rank, world):
    """Rank W-1 sleeps after every barrier of the kernel (before reading its buffer), so its
    peers run ahead into their next call and push it while it reads."""
    import time
    if rank != world - 1:
        return
    barrier = module.block_barrier

    def late(*args):
        barrier(*args)
        time.sleep(0.05)
    module.block_barrier = late  # the interpreter resolves the kernel's globals per call


def _call(world, rank, case, call, device):
    """(x, callable options, float64 reference by output name) of one call of `case`."""
    shard, dtype, epilogue = case
    xs, residuals, weight = _callable_inputs(world, shard, dtype, call)
    if epilogue == "chain":
        return xs[rank].to(device), dict(epilogue=CHAIN), {"out": _chain_reference(xs, world)}
    out, pres = _callable_reference(xs, residuals, weight, world)
    options = dict(weight=weight.to(device), residual=residuals[rank].to(device),
                   eps=CALLABLE_EPS)
    return xs[rank].to(device), options, {"out": out, "residual": pres[rank]}


def callable_rank(rank, world, storages, device, cases, late):
    """Each case twice (new inputs) through the one-shot's callable, all calls back to back on
    one buffer (no other collective between them, so a late rank's peers run ahead), then
    through reduce_scatter_all_gather's on another (the shared CPU `storages` by kind, or with
    None their own symmetric buffers on CUDA): per call (case, error, digest of the gathered
    value, whether both callables gave the same bits)."""
    from infini_dist.kernels import one_shot_scatter_gather as one_shot
    from infini_dist.kernels.reduce_scatter_all_gather import KIND, reduce_scatter_all_gather
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    buffers = {kind: from_peer_tensors(s, rank) for kind, s in (storages or {}).items()}
    if late:
        _late(one_shot, rank, world)
    calls = [(case, call, _call(world, rank, case, call, device)) for case in cases
             for call in range(2)]
    outputs = [one_shot.one_shot_scatter_gather(x, buffer=buffers.get(one_shot.KIND), **options)
               for _, _, (x, options, _) in calls]
    results = []
    for (case, call, (x, options, expected)), got in zip(calls, outputs):
        twin = reduce_scatter_all_gather(x, buffer=buffers.get(KIND), **options)
        got, twin = (got, twin) if isinstance(got, tuple) else ((got,), (twin,))
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(got, twin))
        got = dict(zip(expected, got))
        results.append(((case[0], str(case[1]), case[2], call), max_error(got, expected),
                        digest({"out": got["out"]}), same))
    return results


def _check(per_rank):
    assert all(isinstance(r, list) for r in per_rank), repr(per_rank)[:2000]
    for results in zip(*per_rank):
        case = results[0][0]
        tol = 1e-5 if "float32" in case[1] else 3e-2
        for rank, (_, error, _, same) in enumerate(results):
            assert error <= tol, f"{case} rank {rank}: error {error}"
            assert same, f"{case} rank {rank}: not reduce_scatter_all_gather's bits"
        assert len({bits for _, _, bits, _ in results}) == 1, f"{case}: ranks differ"


@pytest.mark.parametrize("world", [2, 3])
def test_callable_interpreted(monkeypatch, world):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check(run_ranks(callable_rank, world, shared_storages(world), "cpu", CASES, True,
                     timeout=600, env={"TRITON_INTERPRET": "1"}))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_callable_on_gpus():
    """The callable on 2 GPUs over NCCL, its symmetric buffer its own (allocated on first use)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from multirank import SAFE_GPU_ENV
    _check(run_ranks(callable_rank, 2, None, "cuda", GPU_CASES, False, backend="nccl",
                     env=SAFE_GPU_ENV, timeout=540))


# ---- where the engine offers it --------------------------------------------------------------

def _span(graph):
    return FusedSpan(graph, (), (0,), tuple(range(1, len(graph.nodes))))


def test_offered_where_it_gathers_small_tensors_with_no_other_rank_side_data():
    from infini_dist.scheduler.backends.symm import ONE_SHOT_MAX_BYTES
    from infini_dist.scheduler.backends.symm_scatter import (OneShotScatterGather,
                                                             SymmScatterGather)
    cuda = RunContext(None, 2, 0, torch.device("cuda"))
    one_shot, scatter_gather = OneShotScatterGather(), SymmScatterGather()

    def offered(pattern, shape=(4, 40), ctx=cuda):
        graph = _graph(ctx.world_size, pattern)
        meta = _meta(graph, ctx.world_size, shape, F32)
        assert scatter_gather.supports(_span(graph), meta, ctx) or ctx is not cuda
        return one_shot.supports(_span(graph), meta, ctx)
    assert offered("norm_gather") and offered("train_gather") and offered("static_fp8_gather")
    assert not offered("final_norm")         # nothing gathered: every rank reduced x for nothing
    assert not offered("fp8_gather")         # per-row scales of every row
    assert not offered("side_gather")        # another rank's shard of a chain operand
    rows = ONE_SHOT_MAX_BYTES // (1024 * 4)  # x at the cap, then one row pair past it
    assert offered("norm_gather", (rows, 1024)) and not offered("norm_gather", (rows + 2, 1024))
    assert not offered("norm_gather", ctx=RunContext(None, 2, 0, torch.device("cpu")))
    assert not offered("norm_gather", ctx=RunContext(None, 2, 0, torch.device("cuda"),
                                                     single_host=False))


def test_the_engine_offers_both_for_a_span_that_gathers():
    from infini_dist.scheduler.choices import generate_choices
    from infini_dist.scheduler.boundary import find_sites
    graph = _graph(2, "norm_gather")
    (site,) = find_sites(graph)
    names = {c.name for c in generate_choices(
        graph, site, _meta(graph, 2, (4, 40), F32), RunContext(None, 2, 0, torch.device("cuda")),
        fusion_types=("epilogue", "prologue", "cross_subgraph"), max_depth=5, recursive=True)}
    assert {"native", "symm_scatter_gather[p0,e2]", "one_shot_scatter_gather[p0,e2]"} <= names
    # only the whole span: without the gather it has nothing to win
    assert [n for n in names if n.startswith("one_shot_scatter_gather")] == [
        "one_shot_scatter_gather[p0,e2]"]
