"""scheduler/sum_first: coalesced all_reduces only added up become one all_reduce of the sum
(GPT-NeoX's parallel residual), checked as a rewrite and end to end on 2 and 3 gloo ranks."""

import pytest
import torch

from multirank import run_ranks

ROWS, HIDDEN = 4, 16


def neox_graph(reduce_op="sum"):
    """attention and MLP partials, each reduced, plus biases and the residual, then LayerNorm."""
    from infini_dist.scheduler.ir import OpNode, SubGraph
    reduce = {"op": reduce_op}
    return SubGraph((OpNode("all_reduce", ("attn",), ("a",), reduce),
                     OpNode("all_reduce", ("mlp",), ("m",), reduce),
                     OpNode("add", ("a", "b_attn"), ("a_b",)),
                     OpNode("add", ("m", "b_mlp"), ("m_b",)),
                     OpNode("add", ("m_b", "a_b"), ("both",)),
                     OpNode("add", ("both", "res"), ("h",)),
                     OpNode("layer_norm", ("h", "w", "bias"), ("out",))),
                    ("attn", "mlp", "b_attn", "b_mlp", "res", "w", "bias"), ("out", "h"))


def _site(graph):
    from infini_dist.scheduler.boundary import find_sites
    (site,) = find_sites(graph)
    return site


def _meta(graph, values):
    from infini_dist.scheduler.shapes import site_meta
    return site_meta(graph, _site(graph).region, values, torch.device("cpu"))


def inputs_for(rank):
    own, shared = torch.Generator().manual_seed(10 + rank), torch.Generator().manual_seed(3)
    return {"attn": torch.randn(ROWS, HIDDEN, generator=own),
            "mlp": torch.randn(ROWS, HIDDEN, generator=own),
            "b_attn": torch.randn(HIDDEN, generator=shared),
            "b_mlp": torch.randn(HIDDEN, generator=shared),
            "res": torch.randn(ROWS, HIDDEN, generator=shared),
            "w": torch.rand(HIDDEN, generator=shared) + 0.5,
            "bias": torch.randn(HIDDEN, generator=shared)}


def expected(world):
    parts = [inputs_for(r) for r in range(world)]
    one = {k: v.double() for k, v in parts[0].items()}
    h = sum(p["attn"].double() + p["mlp"].double() for p in parts) + one["b_attn"] + \
        one["b_mlp"] + one["res"]
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + 1e-5) * one["w"] + one["bias"], h


def test_rewrite_sums_the_partials_before_one_all_reduce():
    from infini_dist.scheduler import sum_first
    graph = neox_graph()
    new, site, meta = sum_first.rewrite(graph, _site(graph), _meta(graph, inputs_for(0)))
    assert [(n.op_type, n.inputs) for n in new.nodes[:2]] == [("add", ("attn", "mlp")),
                                                              ("all_reduce", ("h.sum_first0",))]
    assert [n.inputs[1] for n in new.nodes[2:5]] == ["b_attn", "b_mlp", "res"]
    assert new.nodes[4].outputs == ("h",) and new.nodes[5].op_type == "layer_norm"
    assert (new.input_names, new.output_names) == (graph.input_names, graph.output_names)
    assert (site.anchors, site.prologue, site.epilogue) == ((1,), (0,), (2, 3, 4, 5))
    assert meta["h.sum_first0"] == meta["h"]


def test_rewrite_applies_only_where_the_sum_is_all_that_reads_the_reductions():
    from infini_dist.scheduler import sum_first
    from infini_dist.scheduler.ir import OpNode, SubGraph
    graph = neox_graph()
    values = inputs_for(0)
    leaky = SubGraph(graph.nodes, graph.input_names, ("out", "h", "a"))  # a partial read outside
    not_sum = neox_graph("max")
    computed_leaf = SubGraph(graph.nodes[:2] + (OpNode("relu", ("res",), ("r",)),
                                                 OpNode("add", ("a", "m"), ("s",)),
                                                 OpNode("add", ("s", "r"), ("h",))),
                             graph.input_names, ("h",))
    for g in (leaky, not_sum, computed_leaf):
        assert sum_first.rewrite(g, _site(g), _meta(g, values)) is None
    wide = dict(values, mlp=values["mlp"].double())  # a partial of another dtype than the sum
    assert sum_first.rewrite(graph, _site(graph), _meta(graph, wide)) is None


def sum_first_rank(rank, world):
    import infini_dist
    from infini_dist.scheduler import engine
    from infini_dist.scheduler.store import STORE
    # Every sum-first choice fastest, all else slow: the sum-first rewrite must be committed.
    STORE.timing_hook = lambda m: {n: 1.0 if n.startswith("sum_first+") else 9.0 for n in m}
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=1,
                                      enable_disk_cache=False):
            executor = engine.GraphExecutor(neox_graph(), infini_dist.config.snapshot())
            out = executor.run(inputs_for(rank))
            choice = executor.site_runners()[0].last_tuning["choice"]
    finally:
        STORE.timing_hook = None
    return {"out": out["out"], "h": out["h"], "choice": choice}


@pytest.mark.parametrize("world", [2, 3])
def test_sum_first_choice_matches_the_reference_on_every_rank(world):
    results = run_ranks(sum_first_rank, world, timeout=240)
    out, h = expected(world)
    for r in results:
        assert r["choice"].startswith("sum_first+"), r["choice"]
        torch.testing.assert_close(r["out"].double(), out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["h"].double(), h, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(r["out"], results[0]["out"]) for r in results)
    assert len({r["choice"] for r in results}) == 1
