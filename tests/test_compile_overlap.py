"""The "overlap" fusion type: in a backward graph the weight-gradient GEMMs of the linears whose
input gradient an all_reduce completes join that all_reduce's site as work beside it
(compile/matmul_match.py's weight_gradients -> the IR op weight_gradient), the IR keeps them in
the site (scheduler/boundary.py's Site.beside), and the choice generator runs them first in every
choice but those of a runs_beside algorithm (scheduler/backends/symm_overlap.py), which runs them
while the collective is in flight. The end-to-end check (a TP decoder's training on gloo, loss
curves equal to plain compile's) is tests/test_bench_train.py's."""

from __future__ import annotations

import pytest
import torch

from fx_graphs import ar, export, fuse, ops_of, rand

aten = torch.ops.aten
ON = ("epilogue", "prologue", "cross_subgraph", "overlap")


def one_linear(g, w, x, s):
    # a column-parallel linear's backward, as autograd orders it: weight gradient first
    dw = torch.mm(g.t(), x)
    return ar(torch.mm(g, w)) * s, dw


def wgrad_after(g, w, x, s):
    # the weight gradient placed after the all_reduce: the site takes it back beside
    out = ar(torch.mm(g, w)) * s
    return out, torch.mm(g.t(), x)


def three_linears(g1, g2, g3, w1, w2, w3, x, s):
    # q, k and v apart (HF Llama, torchtitan): three input gradients added, three GEMMs beside
    dx = torch.mm(g1, w1) + torch.mm(g2, w2) + torch.mm(g3, w3)
    dws = [torch.mm(g.t(), x) for g in (g1, g2, g3)]
    return (ar(dx) * s, *dws)


def rows_3d(g, w, x, s):
    # 3-D gradients: both GEMMs read views of the same rows
    n, k = g.shape[-1], x.shape[-1]
    dw = torch.mm(g.reshape(-1, n).t(), x.reshape(-1, k))
    return ar(g @ w) * s, dw


def read_inside(g, w, x, s):
    # the weight gradient feeds the site's epilogue: not independent, left where it is
    dw = torch.mm(g.t(), x)
    return ar(torch.mm(g, w)) * s + dw.sum(), dw


T, N, K = 6, 8, 4
CASES = [  # fn, args, weight_gradient ops expected with the type on
    (one_linear, (rand(T, N), rand(N, K, seed=1), rand(T, K, seed=2), rand(T, K, seed=3)), 1),
    (wgrad_after, (rand(T, N), rand(N, K, seed=1), rand(T, K, seed=2), rand(T, K, seed=3)), 1),
    (three_linears, (rand(T, N), rand(T, 2, seed=4), rand(T, 2, seed=5), rand(N, K, seed=1),
                     rand(2, K, seed=6), rand(2, K, seed=7), rand(T, K, seed=2),
                     rand(T, K, seed=3)), 3),
    (rows_3d, (rand(2, 3, N), rand(N, K, seed=1), rand(2, 3, K, seed=2),
               rand(2, 3, K, seed=3)), 1),
    (read_inside, (rand(T, N), rand(N, K, seed=1), rand(T, K, seed=2), rand(T, K, seed=3)), 0),
]


@pytest.mark.parametrize("fn,args,expected", CASES, ids=[c[0].__name__ for c in CASES])
def test_the_pass_takes_weight_gradients_beside_only_with_the_type(fn, args, expected):
    import infini_dist
    assert "overlap" not in infini_dist.config.custom_op_fusion_types  # off by default
    # the input gradient's GEMM stays outside the site (matmul_prologue would take it in)
    (off,) = fuse(export(fn, *args), matmul_prologue=False)
    assert "weight_gradient" not in ops_of(off)
    gm = export(fn, *args)
    mms = sum(n.target is aten.mm.default for n in gm.graph.nodes)
    (on,) = fuse(gm, custom_op_fusion_types=ON, matmul_prologue=False)
    assert ops_of(on)[:expected] == ["weight_gradient"] * expected
    assert ops_of(on)[expected:] == ops_of(off)  # the site itself as it was
    # the GEMMs taken are gone from the graph, the input gradients' GEMMs stay
    assert sum(n.target is aten.mm.default for n in gm.graph.nodes) == mms - expected
    fused = next(n for n in gm.graph.nodes if n.target is torch.ops.infini_dist.fused_site.default)
    shapes = [tuple(v.shape) for v in fused.meta["val"][:expected]]
    widths = [a.shape[-1] for a in args[:3]] if fn is three_linears else [N]
    assert shapes == [(w, K) for w in widths][:expected]
    gm.graph.lint()


def test_the_ir_keeps_beside_work_in_the_site_and_runs_it_first_elsewhere():
    """Site.beside: the weight_gradient nodes right before the site, none that the site reads;
    in the region (the native choice runs them); each choice of an algorithm that does not run
    them has them as its first step; only with the type."""
    from infini_dist.scheduler.choices import FusedSpan
    from infini_dist.scheduler.ir import OpNode, SubGraph
    from infini_dist.scheduler.boundary import find_sites
    wg = OpNode("weight_gradient", ("g", "a"), ("dw",))
    graph = SubGraph((wg, OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("mul", ("y", "s"), ("o",))), ("g", "a", "x", "s"), ("dw", "o"))
    (site,) = find_sites(graph, ON)
    assert site.beside == (0,) and site.region == (0, 1, 2)
    (plain,) = find_sites(graph, ON[:3])
    assert plain.beside == () and plain.region == (1, 2)
    # the epilogue reads the GEMM's output: not beside
    reads = SubGraph((wg, OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("mul", ("y", "dw"), ("o",))), ("g", "a", "x"), ("o",))
    assert find_sites(reads, ON)[0].beside == ()
    span = FusedSpan(graph, (), (1,), (2,), (0,))
    assert span.fuses_anything and span.inputs == ("g", "a", "x", "s")
    assert span.outputs == ("dw", "o")
    assert not FusedSpan(graph, (), (1,), ()).fuses_anything


def test_choices_run_the_beside_work_first_or_take_it():
    from infini_dist.scheduler.choices import (Algorithm, RunContext, generate_choices,
                                               register_algorithm, unregister_algorithm)
    from infini_dist.scheduler.ir import OpNode, SubGraph
    from infini_dist.scheduler.boundary import find_sites
    from symm_cases import meta_of

    class Takes(Algorithm):
        name, runs_beside = "test_takes_beside", True

        def supports(self, span, meta, ctx):
            return True

    class DuckTyped:  # a registered algorithm need not subclass Algorithm
        name = "test_duck_typed"

        def supports(self, span, meta, ctx):
            return True

    graph = SubGraph((OpNode("weight_gradient", ("g", "a"), ("dw",)),
                      OpNode("all_reduce", ("x",), ("y",)), OpNode("mul", ("y", "s"), ("o",))),
                     ("g", "a", "x", "s"), ("dw", "o"))
    ctx = RunContext(None, 2, 0, torch.device("cpu"))
    meta = meta_of(graph, (4, 8), torch.float32, "cpu")
    register_algorithm("all_reduce", "cpu", Takes())
    register_algorithm("all_reduce", "cpu", DuckTyped())
    try:
        choices = {c.name: c for c in generate_choices(
            graph, find_sites(graph, ON)[0], meta, ctx, fusion_types=ON, max_depth=2,
            recursive=True)}
        plain = {c.name: c for c in generate_choices(
            graph, find_sites(graph, ON[:3])[0], meta, ctx, fusion_types=ON[:3], max_depth=2,
            recursive=True)}
    finally:
        unregister_algorithm("all_reduce", "cpu", "test_takes_beside")
        unregister_algorithm("all_reduce", "cpu", "test_duck_typed")
    assert choices["native"].steps == [("nodes", (0, 1, 2))]
    takes = [c for name, c in choices.items() if name.startswith("test_takes_beside")]
    assert takes and all(c.span.beside == (0,) and c.steps[0][0] == "span" for c in takes)
    others = [c for name, c in choices.items() if name != "native" and c not in takes]
    assert others and all(c.steps[0] == ("nodes", (0,)) and c.span.beside == () for c in others)
    assert any(name.startswith("test_duck_typed") for name in choices)
    assert not any(name.startswith("test_takes_beside") for name in plain)  # nothing beside
