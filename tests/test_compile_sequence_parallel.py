"""Sequence-parallel sites: reduce_scatter and all_gather anchors, and the span
reduce_scatter -> add + RMSNorm -> all_gather as one site (the pass on post-grad graphs, and
torch's TP-tutorial plan on 2 gloo ranks, forward and backward, against eager SP)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fx_graphs import FUSED, c10d, export, fuse, llama_norm, ops_of, rand
from multirank import run_ranks
from test_compile_tp import _env, _one_compile_thread


def rs(x, group="g0", size=2):
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", size, group))


def ag(x, group="g0", size=2):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, size, group))


def _fused_count(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is FUSED)


def test_reduce_scatter_norm_all_gather_is_one_site():
    def f(x, residual, w):
        h = rs(x) + residual
        return ag(llama_norm(h, w)), h
    gm = export(f, rand(8, 16), rand(4, 16, seed=1), rand(16, seed=2))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["reduce_scatter", "add_rms_norm", "all_gather"]
    scatter, norm, gather = sub.nodes
    assert scatter.attr("group_size") == 2 and gather.attr("group_name") == "g0"
    assert gather.inputs == (norm.outputs[0],)
    assert set(sub.output_names) == {norm.outputs[1], gather.outputs[0]}  # the residual stays
    assert _fused_count(gm) == 1 and not any(
        n.target in (c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default)
        for n in gm.graph.nodes)


def test_the_engine_finds_the_same_span_in_the_site_text():
    from infini_dist.scheduler.boundary import find_sites

    def f(x, residual, w):
        h = rs(x) + residual
        return ag(llama_norm(h, w)), h
    (sub,) = fuse(export(f, rand(8, 16), rand(4, 16, seed=1), rand(16, seed=2)))
    (site,) = find_sites(sub)
    assert site.anchors == (0,) and site.epilogue == (1, 2) and site.prologue == ()


def test_all_gather_takes_its_norm_as_prologue():
    def f(x, w):
        return ag(torch.relu(llama_norm(x, w)) * 2.0)
    gm = export(f, rand(4, 16), rand(16, seed=2))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["rms_norm", "relu", "scale", "all_gather"]


@pytest.mark.parametrize("case", ["lone_scatter", "lone_gather", "other_group", "norm_shared"])
def test_what_stays_with_inductor(case):
    """A reduce_scatter or all_gather with nothing to fuse has no kernel of ours: no site. A
    gather on another group does not close the span; a norm read elsewhere is no prologue."""
    def f(x, residual, w):
        if case == "lone_scatter":
            return (rs(x) @ w.view(16, 1),)
        if case == "lone_gather":
            return (ag(residual) @ w.view(16, 1),)
        if case == "other_group":
            h = rs(x) + residual
            return ag(llama_norm(h, w), "g1"), h
        n = llama_norm(residual, w)
        return ag(n), n * 3.0
    gm = export(f, rand(8, 16), rand(4, 16, seed=1), rand(16, seed=2))
    subs = fuse(gm)
    expected = {"lone_scatter": [], "lone_gather": [],
                "other_group": [["reduce_scatter", "add_rms_norm"]], "norm_shared": []}
    assert [ops_of(s) for s in subs] == expected[case]


class _Offers:
    """A stand-in algorithm: supports every span, or (gather=True) a lone all_gather of at most
    `most` elements, as kernels/lamport_all_gather.py's algorithm does up to its cap."""

    def __init__(self, gather=False, most=64):
        self.gather, self.most = gather, most

    def supports(self, span, meta, ctx):
        if not self.gather:
            return True
        (x,) = (meta[n] for n in span.graph.input_names)
        return not span.prologue and not span.epilogue and math.prod(x.shape) <= self.most


def test_on_gpus_an_all_gather_is_a_site_of_its_own(monkeypatch):
    """On GPUs our all_gather kernel takes the tensor as it is: a gather is a site alone, where
    an algorithm of ours runs it (here: a stand-in that takes up to 64 elements), and a norm
    before it stays in Inductor's kernel, which a site would split; a gather too big for ours
    stays Inductor's too. The reduce_scatter span, which our kernels run, stays one site. The
    CPU backend makes every site with its prologue (it tests them); here CPU plays a GPU with
    CUDA's registry (the patterns are traced on the graph's device, so a CUDA graph cannot be
    matched on this machine)."""
    from infini_dist.compile import anchors, passes
    from infini_dist.scheduler.choices import algorithms_for

    def f(x, residual, w):
        h = rs(x) + residual
        return (ag(llama_norm(h, w)), ag(torch.relu(llama_norm(residual, w)) * 2.0), h,
                ag(x * 3.0))
    args = rand(8, 16), rand(4, 16, seed=1), rand(16, seed=2)
    assert [ops_of(s) for s in fuse(export(f, *args))] == [
        ["reduce_scatter", "add_rms_norm", "all_gather"],
        ["rms_norm", "relu", "scale", "all_gather"], ["scale", "all_gather"]]
    if algorithms_for("reduce_scatter", "cuda"):  # where the GPU backend imports: its registry
        assert all(algorithms_for(op, "cuda") for op in ("all_reduce", "reduce_scatter",
                                                         "all_gather"))
    monkeypatch.setattr(anchors, "SPEED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(passes, "algorithms_for",
                        lambda op, device: [_Offers(gather=op == "all_gather")])
    gm = export(f, *args)
    assert [ops_of(s) for s in fuse(gm)] == [["reduce_scatter", "add_rms_norm", "all_gather"],
                                             ["all_gather"]]
    # the norm before the second gather, and the third gather (128 elements), are Inductor's
    assert sum(1 for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default) == 1
    assert any(n.target is torch.ops.aten.rsqrt.default for n in gm.graph.nodes)


def test_on_gpus_a_lone_reduce_scatter_stays_inductors(monkeypatch):
    """symm_scatter_gather could run it, but such sites were not shown to pay in torchtitan's
    SP step (scatter_gather_match.ALONE_WHERE_OURS): a reduce_scatter alone stays Inductor's
    even where an algorithm of ours supports it; its span with an epilogue is still a site."""
    from infini_dist.compile import anchors, passes

    def f(x, residual, w):
        return rs(x) @ w.view(16, 1), rs(x * 2.0) + residual
    monkeypatch.setattr(anchors, "SPEED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(passes, "algorithms_for", lambda op, device: [_Offers()])
    gm = export(f, rand(8, 16), rand(4, 16, seed=1), rand(16, seed=2))
    assert [ops_of(s) for s in fuse(gm)] == [["scale", "reduce_scatter", "add"]]
    assert sum(1 for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default) == 1


def test_a_gather_of_a_dynamic_shape_is_left_to_the_engine(monkeypatch):
    """The pass does not ask a dynamic shape's size (that would guard on it: a recompile per
    size): the lone gather is a site where an algorithm of ours runs gathers at all, and the
    engine decides per shape at run time."""
    from types import SimpleNamespace

    from infini_dist.compile import anchors, passes
    from infini_dist.scheduler.ir import OpNode, SubGraph

    class Asked:
        def supports(self, span, meta, ctx):
            raise AssertionError("a dynamic size was asked for")

    text = SubGraph((OpNode("all_gather", ("in0",), ("v0",), {"group_size": 2,
                                                               "group_name": "g"}),),
                    ("in0",), ("v0",)).canonical()
    dynamic = object()  # a SymInt stands here: not an int
    nodes = [SimpleNamespace(meta={"val": SimpleNamespace(shape=(rows, 16))})
             for rows in (dynamic, dynamic)]
    gather = SimpleNamespace(op_type="all_gather", attrs={"group_size": 2})
    monkeypatch.setattr(anchors, "speed_device", lambda anchor: torch.device("cuda"))
    monkeypatch.setattr(passes, "algorithms_for", lambda op, device: [Asked()])
    assert passes._ours_alone(gather, text, nodes[:1], nodes[1:])
    monkeypatch.setattr(passes, "algorithms_for", lambda op, device: [])
    assert not passes._ours_alone(gather, text, nodes[:1], nodes[1:])


def test_a_gather_of_the_wrong_size_fails_clearly():
    from infini_dist.scheduler import op_registry
    with pytest.raises(ValueError, match="equal chunks"):
        op_registry.fake_outputs("reduce_scatter", [torch.empty(5, 4)], {"group_size": 2})
    (out,) = op_registry.fake_outputs("all_gather", [torch.empty(3, 4)], {"group_size": 4})
    assert out.shape == (12, 4)


# ---- torch's TP-tutorial plan with sequence parallelism, trained one step ----------------------

def sp_training_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import infini_dist.compile as idc
    from infini_dist.launch import sp_model
    _one_compile_thread()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same full weights and input on every rank
    full = sp_model.Model()
    eager = sp_model.shard(copy.deepcopy(full), mesh)
    model = sp_model.shard(copy.deepcopy(full), mesh)
    x = torch.randn(2, 8, 16)
    grad = torch.randn(2, 8, 16)
    shard = x.chunk(world, dim=1)[rank].contiguous()
    local_grad = grad.chunk(world, dim=1)[rank]
    results = {}
    with idc.recording() as graphs:  # every graph the pass rewrites: forward and backward
        for name, module, fn in (("eager", eager, eager), ("compiled", model,
                                                           idc.compile_model(model))):
            inputs = shard.clone().requires_grad_(True)
            out = fn(inputs)
            out.backward(local_grad)
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for n, p in module.named_parameters()}
            results[name] = (out.detach(), inputs.grad, grads)
    reference = full(x).chunk(world, dim=1)[rank]
    (out, x_grad, grads), (e_out, e_x_grad, e_grads) = results["compiled"], results["eager"]
    return {"graphs": [list(g.sites) for g in graphs], "kinds": [g.kind for g in graphs],
            "eager_vs_full": float((e_out - reference).abs().max()),
            "out": float((out - e_out).abs().max()),
            "x_grad": float((x_grad - e_x_grad).abs().max()),
            "grads": max(float((grads[n] - e_grads[n]).abs().max()) for n in grads)}


def test_tp_tutorial_sequence_parallel_trains_with_the_pass():
    from infini_dist.scheduler.ir import subgraph_from_text
    results = run_ranks(sp_training_rank, 2, env=_env(), timeout=300)
    for r in results:
        assert r["eager_vs_full"] < 1e-5  # the sharding itself is right
        assert r["out"] < 1e-5 and r["x_grad"] < 1e-5 and r["grads"] < 1e-5
        assert r["kinds"] == ["forward", "backward"]
        forward, backward = r["graphs"][0], r["graphs"][1]
        ops = [[n.op_type for n in subgraph_from_text(t).nodes] for t in forward]
        # Layer 0's gather takes what the norm computes after the rsqrt, which backward keeps.
        assert ops[0] == ["mul", "mul", "all_gather"]
        # wo and w2 of layer 0 and wo of layer 1: add + RMSNorm between scatter and gather, the
        # rsqrt exposed for backward; w2 of layer 1 ends in the final norm.
        assert ops[1:] == [["reduce_scatter", "add_rms_norm", "rms_rstd", "all_gather"]] * 3 + [
            ["reduce_scatter", "add_rms_norm", "rms_rstd"]]
        back = [[n.op_type for n in subgraph_from_text(t).nodes] for t in backward]
        print(back)
        assert back, "the backward graph went through the pass"
    assert results[0]["graphs"] == results[1]["graphs"]
