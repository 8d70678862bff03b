"""The matmul prologue (config.matmul_prologue): the pass takes the mm / addmm / linear that
makes an all_reduce's input into the site only with the flag on (or "auto", the default, in a
graph Inductor captures in CUDA graphs on CUDA tensors), the IR makes it the head of
the prologue chain, the choices cover (a) the matmul natively then every all-reduce choice,
(b) gemm_one_shot and (c) torch's fused matmul + reduce-scatter, and a compiled TP block with
the flag on matches eager on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fx_graphs import ar, export, fuse, ops_of, rand
from gemm_cases import PATTERNS, meta_of
from multirank import run_ranks
from test_compile_tp import _env, _max_diff, sharded_block

aten = torch.ops.aten


def linear_3d(x, w, r):
    return ar(F.linear(x, w)) + r


def linear_bias(x, w, b, r):
    return ar(F.linear(x, w, b)) + r


def matmul_3d(x, w, r):
    return ar(x @ w) + r


def mm(x, w, r):
    return ar(torch.mm(x, w)) + r


def test_the_flag_is_auto_by_default_validated_and_in_the_pass_uuid():
    import infini_dist
    from infini_dist.compile import FUSION_PASS
    from infini_dist.config import parse_env
    assert infini_dist.config.matmul_prologue == "auto"
    for bad in (1, "on"):
        with pytest.raises((TypeError, ValueError), match="matmul_prologue"):
            infini_dist.config.matmul_prologue = bad
    assert parse_env("matmul_prologue", "on") is True
    assert parse_env("matmul_prologue", "AUTO") == "auto"
    with pytest.raises(ValueError, match="INFINI_DIST_MATMUL_PROLOGUE"):
        parse_env("matmul_prologue", "sometimes")
    before = FUSION_PASS.uuid()
    for value in (True, False):
        with infini_dist.config.patch(matmul_prologue=value):
            assert FUSION_PASS.uuid() != before  # Inductor's FX graph cache keeps them apart


def _on_cuda(gm, keep_on_cpu=()):
    """`gm` as the pass sees a graph of CUDA tensors: every node's fake value on cuda:0 (made by
    the graph's own fake mode, which the pass's shape propagation shares), but the nodes named
    in `keep_on_cpu`."""
    with gm.graph.find_nodes(op="placeholder")[0].meta["val"].fake_mode:
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and node.name not in keep_on_cpu:
                node.meta["val"] = torch.empty_strided(value.shape, value.stride(),
                                                       dtype=value.dtype, device="cuda")
    return gm


@pytest.mark.parametrize("cudagraphs,cuda,taken", [(True, True, True), (False, True, False),
                                                   (True, False, False)])
def test_auto_takes_the_matmul_only_in_cuda_graphs_on_cuda(cudagraphs, cuda, taken):
    """"auto": the GEMM joins the site only where Inductor captures the graph in CUDA graphs
    (mode="reduce-overhead" sets triton.cudagraphs for its compile) and the tensors are on
    CUDA; else the site is the one without the flag."""
    import torch._inductor.config as inductor_config
    fn, args = linear_3d, CASES[0][1]
    gm = export(fn, *args)
    with inductor_config.patch({"triton.cudagraphs": cudagraphs}):
        (site,) = fuse(_on_cuda(gm) if cuda else gm, matmul_prologue="auto")
    # fake CUDA values trace the epilogue's forms on "meta" here (compile/fx_patterns.py), so
    # the site keeps its add as it does on a GPU
    assert ops_of(site) == (["matmul"] if taken else []) + ["all_reduce", "add"]


@pytest.mark.parametrize("partition,taken", [(False, False), (True, True)])
def test_auto_leaves_the_matmul_where_inductor_skips_the_capture(partition, taken):
    """A graph that reads a CPU tensor is not captured (Inductor's cudagraph_utils skips it)
    unless graph partition splits the CPU work off: "auto" follows, so a graph run launch by
    launch does not pay a matmul site's host time."""
    import torch._inductor.config as inductor_config

    def with_cpu_work(x, w, r, count):
        return linear_3d(x, w, r), count + 1  # e.g. a step counter kept on the host
    gm = export(with_cpu_work, *CASES[0][1], torch.tensor(3.0))
    counter = gm.graph.find_nodes(op="placeholder")[-1]
    cpu = {counter.name} | {user.name for user in counter.users}  # the counter and its + 1
    with inductor_config.patch({"triton.cudagraphs": True, "graph_partition": partition}):
        (site,) = fuse(_on_cuda(gm, keep_on_cpu=cpu), matmul_prologue="auto")
    assert ops_of(site) == (["matmul"] if taken else []) + ["all_reduce", "add"]


X3, X2 = (2, 4, 8), (4, 8)
CASES = [  # fn, args, transpose_weight, inputs of the matmul
    (linear_3d, (rand(*X3), rand(16, 8, seed=1), rand(2, 4, 16, seed=2)), True, 2),
    (linear_bias, (rand(*X3), rand(16, 8, seed=1), rand(16, seed=3), rand(2, 4, 16)), True, 3),
    (linear_bias, (rand(*X2), rand(16, 8, seed=1), rand(16, seed=3), rand(4, 16)), True, 3),
    (matmul_3d, (rand(*X3), rand(8, 16, seed=1), rand(2, 4, 16)), False, 2),
    (mm, (rand(*X2), rand(8, 16, seed=1), rand(4, 16)), False, 2),
    (linear_3d, (rand(*X3, dtype=torch.bfloat16), rand(16, 8, dtype=torch.bfloat16),
                 rand(2, 4, 16, dtype=torch.bfloat16)), True, 2),
]


@pytest.mark.parametrize("fn,args,transpose,arity", CASES)
def test_pass_takes_the_matmul_only_with_the_flag(fn, args, transpose, arity):
    (off,) = fuse(export(fn, *args), matmul_prologue=False)
    assert ops_of(off) == ["all_reduce", "add"]  # the site as it was before the flag existed
    gm = export(fn, *args)
    (on,) = fuse(gm, matmul_prologue=True)
    assert ops_of(on) == ["matmul", "all_reduce", "add"]
    matmul = on.nodes[0]
    assert matmul.attr("transpose_weight") is transpose and len(matmul.inputs) == arity
    assert on.input_names[:arity] == matmul.inputs  # x [..., K], the weight as the model holds it
    # the GEMM, its views and the weight's transpose left with the site
    targets = {n.target for n in gm.graph.nodes}
    assert not targets & {aten.mm.default, aten.addmm.default, aten.permute.default}
    # the op's fake output has the all_reduce's shape
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.infini_dist.fused_site.default]
    assert tuple(fused[0].meta["val"][0].shape) == tuple(args[-1].shape)


def shared_transpose(x, w, r):
    wt = w.t()  # read again below, so it stays a graph value
    return ar(torch.mm(x, wt)) + r, wt * 2


def read_twice(x, w, r):
    p = torch.mm(x, w)
    return ar(p) + r, p


def scaled_addmm(x, w, b, r):
    return ar(torch.addmm(b, x, w, beta=2.0)) + r


def rows_bias(x, w, b, r):
    return ar(torch.addmm(b, x, w)) + r  # b [rows, N]: no linear's bias


def test_pass_leaves_what_others_read_and_what_is_no_linear():
    x, w, r = rand(*X2), rand(16, 8, seed=1), rand(4, 16)
    (site,) = fuse(export(shared_transpose, x, w, r), matmul_prologue=True)
    assert ops_of(site) == ["matmul", "all_reduce", "add"]
    assert site.nodes[0].attr("transpose_weight") is False  # reads the shared transpose
    for fn, args in ((read_twice, (x, w.t(), r)), (scaled_addmm, (x, w.t(), rand(16), r)),
                     (rows_bias, (x, w.t(), rand(4, 16), r))):
        (site,) = fuse(export(fn, *args), matmul_prologue=True)
        assert ops_of(site) == ["all_reduce", "add"], fn.__name__


def choice_names(pattern, device, world_size=2, dtype=torch.bfloat16):
    from infini_dist.scheduler.choices import RunContext, generate_choices
    from infini_dist.scheduler.boundary import find_sites
    graph = PATTERNS[pattern]
    site = find_sites(graph)[0]
    ctx = RunContext(None, world_size, 0, torch.device(device))
    choices = generate_choices(graph, site, meta_of(graph, (64, 32), 16, dtype, device), ctx,
                               fusion_types=("epilogue", "prologue", "cross_subgraph"),
                               max_depth=5, recursive=True)
    return {c.name: c for c in choices}


def test_choices_cover_native_matmul_our_gemm_and_torch_reduce_scatter():
    graph = PATTERNS["linear_add_rms_norm"]
    from infini_dist.scheduler.boundary import find_sites
    (site,) = find_sites(graph)
    assert site.prologue == (0,) and site.anchors == (1,) and site.epilogue == (2,)
    cuda = choice_names("linear_add_rms_norm", "cuda")
    # (a) the matmul natively, then every all-reduce choice at every epilogue depth
    for name in ("one_shot", "two_shot", "two_shot_polled_gather"):
        assert {f"{name}[p0,e0]", f"{name}[p0,e1]"} <= set(cuda)
        assert cuda[f"{name}[p0,e1]"].steps[0] == ("nodes", (0,))
    assert "nccl+nt_epilogue[p0,e1]" in cuda
    # (b) our GEMM pushing its tiles, with and without the epilogue; (c) torch's, no epilogue
    assert {"gemm_one_shot[p1,e0]", "gemm_one_shot[p1,e1]"} <= set(cuda)
    assert "torch_mm_reduce_scatter[p1,e0]" in cuda and "torch_mm_reduce_scatter[p1,e1]" not in cuda
    assert not any(n.startswith(("one_shot", "two_shot", "nccl")) and "[p1" in n for n in cuda)
    # rows that do not split over 3 ranks: no reduce-scatter of them
    assert "torch_mm_reduce_scatter[p1,e0]" in choice_names("linear", "cuda", 2)
    assert "torch_mm_reduce_scatter[p1,e0]" not in choice_names("linear", "cuda", 3)
    assert "torch_mm_reduce_scatter[p1,e0]" not in choice_names("mm_bias_relu_scale", "cuda")
    # on CPU (gloo): torch_fused with the matmul natively or inside its span
    cpu = choice_names("linear_add_rms_norm", "cpu", dtype=torch.float32)
    assert {"native", "torch_fused[p0,e1]", "torch_fused[p1,e0]", "torch_fused[p1,e1]"} == set(cpu)


def test_a_weight_is_never_a_token_input():
    """A matmul's weight [N, K] with N equal to the token count keeps its shape in a bucket."""
    import infini_dist
    from infini_dist.scheduler import buckets
    from infini_dist.scheduler.engine import SiteRunner
    from infini_dist.scheduler.boundary import find_sites
    graph = PATTERNS["linear_add_rms_norm"]
    runner = SiteRunner(graph, find_sites(graph)[0], infini_dist.config.snapshot())
    values = {"x": torch.zeros(24, 8), "wm": torch.zeros(24, 8), "res": torch.zeros(24, 24),
              "w": torch.zeros(24)}
    tokens = runner._tokens(values)
    assert tokens.rows == 24 and tokens.bound == 32 and "wm" not in tokens.names
    grown = buckets.at_bound(values, tokens)
    assert grown["wm"].shape == (24, 8) and grown["x"].shape == (32, 8)


# ---- a tensor-parallel block through Inductor, the flag on ---------------------------------------

def _matmul_spans_win(medians):
    # native 10, the whole site in one span (the matmul inside) 8, every other choice 9
    return {n: 10.0 if n == "native" else 8.0 if n.endswith("[p1,e1]") else 9.0
            for n in medians}


def tp_block_rank(rank, world):
    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.scheduler.store import STORE
    infini_dist.config.matmul_prologue = True
    full, block, x = sharded_block(rank, world)
    STORE.timing_hook = _matmul_spans_win
    with torch.no_grad():
        reference, eager = full(x), block(x)
        out = idc.compile_model(block, recompile_decided=False)(x)
    return {"sites": list(idc.last_sites), "compiled_vs_eager": _max_diff(out, eager),
            "tp_vs_full": _max_diff(eager, reference),
            "decided": [(d["op"], d["choice"]) for d in idc.decisions()]}


def test_tp_block_with_the_matmul_prologue_compiled_with_inductor():
    from infini_dist.scheduler.ir import subgraph_from_text
    results = run_ranks(tp_block_rank, 2, env=_env(), timeout=240)
    for r in results:
        assert r["tp_vs_full"] < 1e-5
        subs = [subgraph_from_text(t) for t in r["sites"]]
        # wo and down, each with the projection in its site
        assert [ops_of(s) for s in subs] == [["matmul", "all_reduce", "add_rms_norm"]] * 2
        assert all(s.nodes[0].attr("transpose_weight") for s in subs)
        assert r["compiled_vs_eager"] < 1e-5
        assert sorted(choice for _, choice in r["decided"]) == ["torch_fused[p1,e1]"] * 2
    assert results[0]["decided"] == results[1]["decided"]


# ---- torch_mm_reduce_scatter's runner on gloo, torch's op replaced by its own reference --------

def torch_rs_rank(rank, world):
    import torch.distributed._symmetric_memory as symm_mem

    from infini_dist.scheduler.backends import torch_mm_rs
    from infini_dist.scheduler.choices import FusedSpan, RunContext
    from gemm_cases import make_inputs
    from symm_cases import reference
    # the CUDA op's reference implementation (torch's Meta/fallback kernel), on CPU tensors
    torch_mm_rs._op = lambda: symm_mem._fused_matmul_reduce_scatter_fallback
    graph = PATTERNS["linear_add_rms_norm"]
    span = FusedSpan(graph, (0,), (1,), ())
    ctx = RunContext(None, world, rank, torch.device("cpu"))
    run = torch_mm_rs.TorchMatmulReduceScatter().compile(span, meta_of(graph, (2, 3, 8), 16,
                                                                    torch.float32, "cpu"), ctx)
    everyone = [make_inputs(graph, (2, 3, 8), 16, torch.float32, r, 0) for r in range(world)]
    got = run(everyone[rank])
    want = reference(PATTERNS["linear"], [{"x": e["x"], "wm": e["wm"]} for e in everyone], rank)
    return float((got["y"] - want["y"]).abs().max()), tuple(got["y"].shape)


def test_torch_reduce_scatter_runner_on_gloo(tmp_path):
    for error, shape in run_ranks(torch_rs_rank, 2, timeout=120):
        assert shape == (2, 3, 16) and error < 1e-5
