"""infini_dist.fusion.patterns.llm_patterns: structure, argument checks, and dispatch numerics
against float64 references (single process; 2 gloo ranks for the all_reduce patterns)."""

import json
import math
from pathlib import Path

import pytest
import torch

import infini_dist
from infini_dist.fusion import FusionConfig, FusionScheduler, SubGraph
from infini_dist.fusion.patterns import (create_add_rms_norm_pattern,
                                         create_all_reduce_add_rms_norm_pattern,
                                         create_all_reduce_relu_scale_pattern,
                                         create_gelu_pattern, create_swiglu_pattern)

from multirank import run_ranks

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
ROWS, HIDDEN = 8, 256  # 2048 elements: above the default min_tensor_size


def randn(seed, *shape, dtype=torch.float32, offset=0.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + offset).to(dtype)


# ---- float64 references, written out independently of the op registry ---------------------------

def ref_swiglu(gate, up):
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def ref_gelu(x, approximate):
    x = x.double()
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def ref_add_rms_norm(x, residual, weight, eps):
    total = x.double() + residual.double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed, total


# ---- structure and argument checks ---------------------------------------------------------------

def ops_of(graph):
    return [node.op_type for node in graph.nodes]


def test_pattern_structure():
    cases = [
        (create_swiglu_pattern(), ("gate", "up"), ("output",), ["swiglu"]),
        (create_add_rms_norm_pattern(), ("x", "residual", "weight"), ("output", "residual_out"),
         ["add_rms_norm"]),
        (create_gelu_pattern(), ("x",), ("output",), ["gelu"]),
        (create_all_reduce_relu_scale_pattern(scale=0.25), ("x",), ("output",),
         ["all_reduce", "relu", "scale"]),
        (create_all_reduce_add_rms_norm_pattern(), ("x", "residual", "weight"),
         ("output", "residual_out"), ["all_reduce", "add_rms_norm"]),
    ]
    for graph, inputs, outputs, ops in cases:
        assert isinstance(graph, SubGraph)
        assert (graph.input_names, graph.output_names, ops_of(graph)) == (inputs, outputs, ops)
    assert create_add_rms_norm_pattern(eps=1e-5).nodes[0].attr("eps") == 1e-5
    assert create_all_reduce_add_rms_norm_pattern(eps=2).nodes[1].attr("eps") == 2.0
    assert create_gelu_pattern("tanh").nodes[0].attr("approximate") == "tanh"
    assert create_all_reduce_relu_scale_pattern(scale=0.25).nodes[2].attr("scale") == 0.25
    # Equal arguments give equal (hashable) graphs: one routing decision, one tuning.
    assert create_all_reduce_relu_scale_pattern(2) == create_all_reduce_relu_scale_pattern(2.0)


@pytest.mark.parametrize("build, error, match", [
    (lambda: create_add_rms_norm_pattern(eps=0.0), ValueError, "eps must be > 0"),
    (lambda: create_all_reduce_add_rms_norm_pattern(eps=-1e-6), ValueError, "eps must be > 0"),
    (lambda: create_add_rms_norm_pattern(eps="1e-6"), TypeError, "eps must be a real number"),
    (lambda: create_gelu_pattern("erf"), ValueError, "approximate must be one of"),
    (lambda: create_all_reduce_relu_scale_pattern(scale=float("nan")), ValueError, "finite"),
    (lambda: create_all_reduce_relu_scale_pattern(scale=True), TypeError, "real number"),
])
def test_pattern_arguments_are_checked(build, error, match):
    with pytest.raises(error, match=match):
        build()


# ---- single-process numerics ----------------------------------------------------------------------

def local_cases(dtype):
    gate, up = randn(1, ROWS, HIDDEN, dtype=dtype), randn(2, ROWS, HIDDEN, dtype=dtype)
    x, res = randn(3, ROWS, HIDDEN, dtype=dtype), randn(4, ROWS, HIDDEN, dtype=dtype)
    weight = randn(5, HIDDEN, dtype=dtype, offset=1.0)
    return [
        (create_swiglu_pattern(), {"gate": gate, "up": up},
         {"output": ref_swiglu(gate, up)}),
        (create_gelu_pattern(), {"x": x}, {"output": ref_gelu(x, "none")}),
        (create_gelu_pattern("tanh"), {"x": x}, {"output": ref_gelu(x, "tanh")}),
        (create_add_rms_norm_pattern(eps=1e-5), {"x": x, "residual": res, "weight": weight},
         dict(zip(("output", "residual_out"), ref_add_rms_norm(x, res, weight, 1e-5)))),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_patterns_match_float64(dtype):
    fused, plain = FusionScheduler(), FusionScheduler(FusionConfig(enable_fusion=False))
    for graph, inputs, reference in local_cases(dtype):
        out = fused.dispatch(graph, inputs)
        unfused = plain.dispatch(graph, inputs)
        assert set(out) == set(reference)
        for name, want in reference.items():
            assert out[name].dtype == dtype and out[name].shape == want.shape
            torch.testing.assert_close(out[name].double(), want, rtol=TOL[dtype],
                                       atol=TOL[dtype])
            assert torch.equal(out[name], unfused[name])


# ---- all_reduce patterns on 2 ranks ----------------------------------------------------------------

def reduced_inputs(rank, dtype):
    # x differs per rank; residual and weight are replicated, as in tensor parallelism.
    return {"x": randn(100 + rank, ROWS, HIDDEN, dtype=dtype),
            "residual": randn(7, ROWS, HIDDEN, dtype=dtype),
            "weight": randn(8, HIDDEN, dtype=dtype, offset=1.0)}


def collective_cases(rank, world_size, dtype):
    everyone = [reduced_inputs(r, dtype) for r in range(world_size)]
    mine = everyone[rank]
    # The collective sums in the input dtype: the reference starts from that rounded sum, so
    # the tolerance measures only our ops (one rounding each), not the reduction's rounding.
    x_sum = sum(inputs["x"].double() for inputs in everyone).to(dtype)
    return [
        ("relu_scale", create_all_reduce_relu_scale_pattern(scale=0.5), {"x": mine["x"]},
         {"output": torch.relu(x_sum.double()) * 0.5}),
        ("add_rms_norm", create_all_reduce_add_rms_norm_pattern(eps=1e-6), mine,
         dict(zip(("output", "residual_out"),
                  ref_add_rms_norm(x_sum, mine["residual"], mine["weight"], 1e-6)))),
    ]


def collective_patterns_rank(rank, world_size):
    import hashlib

    from infini_dist.scheduler.store import STORE
    # Every fused choice beats native, so the fused algorithm is what gets committed.
    STORE.timing_hook = lambda medians: {n: t * (1e3 if n == "native" else 1.0)
                                          for n, t in medians.items()}
    fused, plain = FusionScheduler(), FusionScheduler(FusionConfig(enable_fusion=False))
    result = {"errors": {}, "digests": {}, "same_as_unfused": {}}
    with infini_dist.config.patch(benchmark_reps=2, benchmark_warmup=1):
        for dtype in (torch.float32, torch.bfloat16):
            for name, graph, inputs, reference in collective_cases(rank, world_size, dtype):
                case = f"{name}/{dtype}"
                first = fused.dispatch(graph, inputs)
                again = fused.dispatch(graph, inputs)  # committed choice, from the route cache
                unfused = plain.dispatch(graph, inputs)
                result["errors"][case] = max(
                    float(((out[n].double() - reference[n]).abs()
                           / (1 + reference[n].abs())).max())
                    for out in (first, again) for n in reference)
                result["same_as_unfused"][case] = all(
                    torch.allclose(first[n].double(), unfused[n].double(), rtol=TOL[dtype],
                                   atol=TOL[dtype]) for n in reference)
                result["digests"][case] = hashlib.sha256(b"".join(
                    first[n].contiguous().view(torch.uint8).numpy().tobytes()
                    for n in sorted(reference))).hexdigest()
        result["group_name"] = group_name_case(rank, world_size, fused, plain)
    result["stats"] = fused.get_cache_stats()
    result["plain_stats"] = plain.get_cache_stats()
    # Rank 0 of each group writes its tuned decisions to the cache dir: which choices were
    # committed. Each rank tunes its own singleton group, so wait until every rank has written.
    import torch.distributed as dist
    dist.barrier()
    result["committed"] = sorted(json.loads(p.read_text())["choice"]
                                 for p in Path(infini_dist.config.cache_dir).glob("*.json"))
    return result


def group_name_case(rank, world_size, fused, plain):
    """An all_reduce naming its group (as the compile pass writes it) reduces over that group,
    not over the dispatch's: here a group of this rank alone, so nothing is summed."""
    import torch.distributed as dist
    from infini_dist.fusion import OpNode
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # collective: every rank
    graph = SubGraph((OpNode("all_reduce", ("x",), ("x_reduced",),
                             {"group_name": alone.group_name}),
                      OpNode("relu", ("x_reduced",), ("output",))), ("x",), ("output",))
    x = reduced_inputs(rank, torch.float32)["x"]
    return [float((s.dispatch(graph, {"x": x})["output"].double()
                   - torch.relu(x.double())).abs().max()) for s in (plain, fused)]


def test_all_reduce_patterns_on_two_ranks_match_float64():
    ranks = run_ranks(collective_patterns_rank, 2)
    for result in ranks:
        for case, error in result["errors"].items():
            dtype = torch.float32 if "float32" in case else torch.bfloat16
            assert error < TOL[dtype], (case, error)
        assert all(result["same_as_unfused"].values()), result["same_as_unfused"]
        # 2 patterns x 2 dtypes, each routed once (miss) then found (hit); all fused.
        stats = result["stats"]
        assert (stats["size"], stats["misses"], stats["hits"]) == (5, 5, 4), stats
        assert (stats["fused_dispatches"], stats["unfused_dispatches"]) == (9, 0), stats
        assert result["plain_stats"]["unfused_dispatches"] == 5
        assert max(result["group_name"]) < 1e-6, result["group_name"]
    assert ranks[0]["digests"] == ranks[1]["digests"]  # bitwise identical on every rank
    # 4 from rank 0, plus one per singleton group (each rank is rank 0 of its own).
    committed = ranks[0]["committed"]
    assert len(committed) == 6 and all(c.startswith("torch_fused[") for c in committed), committed
