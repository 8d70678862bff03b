"""The compile pass on graphs as AOTAutograd hands them to Inductor (single process, no Inductor
code generation; tests/fx_graphs.py): what becomes a site, what the flags change, the runtime
op and installation. One test per fusion pattern: test_compile_patterns.py.

Collectives name a group ("g0") that never has to exist, since these graphs are only rewritten,
not run (except the user-op site, which needs no group).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import infini_dist
import infini_dist.compile as idc
from infini_dist.compile import runtime_op
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.ir import OpNode, SubGraph
from fx_graphs import FUSED, ar, c10d, export, fuse, llama_norm, ops_of, rand, torch_norm


# ---- what becomes a site ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_and_products_after_the_all_reduce(dtype):
    def f(x, up, s):
        h = ar(x)
        a = F.silu(h) * up            # swiglu, the reduced value as gate
        b = F.gelu(a, approximate="tanh")
        c = F.gelu(b) * s             # gelu, then mul by a tensor
        return torch.sigmoid(c) * 3.0  # sigmoid, scale
    gm = export(f, rand(4, 16, dtype=dtype), rand(4, 16, dtype=dtype, seed=1),
                rand(4, 16, dtype=dtype, seed=2))
    (sub,) = fuse(gm, max_fusion_depth=8)
    assert ops_of(sub) == ["all_reduce", "swiglu", "gelu", "gelu", "mul", "sigmoid", "scale"]
    assert [n.attr("approximate") for n in sub.nodes[2:4]] == ["tanh", "none"]
    assert sub.nodes[-1].attr("scale") == 3.0
    gm = export(f, rand(4, 16, dtype=dtype), rand(4, 16, dtype=dtype, seed=1),
                rand(4, 16, dtype=dtype, seed=2))
    (sub,) = fuse(gm)  # the default depth, 5, caps the chain
    assert ops_of(sub) == ["all_reduce", "swiglu", "gelu", "gelu", "mul", "sigmoid"]


def test_intermediate_values_read_elsewhere_become_outputs():
    def f(x):
        h = ar(x)
        a = torch.relu(h)
        return a * 2.0, a, h
    gm = export(f, rand(4, 16))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "relu", "scale"]
    assert sub.output_names == ("v0", "v1", "v2")  # h, a and the product, in that order
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert [a.args[1] for a in output.args[0]] == [2, 1, 0]


def test_side_input_computed_from_the_site_stops_the_chain():
    def f(x):
        h = ar(x)
        return h * h.sum(-1, keepdim=True)  # the norm of h is not an IR op
    gm = export(f, rand(4, 16))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce"]


def test_adjacent_independent_all_reduces_share_a_site():
    def f(x, y):
        a, b = ar(x), ar(y)
        return torch.relu(a) + b
    gm = export(f, rand(4, 16), rand(4, 16, seed=1))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "all_reduce", "relu", "add"]
    gm = export(f, rand(4, 16), rand(4, 16, seed=1))
    subs = fuse(gm, custom_op_fusion_types=("epilogue", "prologue"))
    # Apart, the first site stops before the second collective (relu comes after it).
    assert [ops_of(s) for s in subs] == [["all_reduce"], ["all_reduce", "add"]]


def test_dependent_or_other_group_all_reduces_stay_apart():
    def f(x, y):
        a = ar(torch.relu(ar(x)))          # the second reads the first
        return a, ar(y, group="g1")          # another group
    gm = export(f, rand(4, 16), rand(4, 16, seed=1))
    subs = fuse(gm)
    assert [ops_of(s) for s in subs] == [["all_reduce", "relu"], ["all_reduce"], ["all_reduce"]]
    assert [s.nodes[0].attr("group_name") for s in subs] == ["g0", "g0", "g1"]


def test_a_site_is_not_moved_across_another_collective():
    def f(x, y):
        h = ar(x)
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(y, 2, "g0"))
        return torch.relu(h), gathered
    gm = export(f, rand(4, 16), rand(4, 16, seed=1))
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    gather = order.index(c10d.all_gather_into_tensor.default)
    assert gather < order.index(torch.ops.aten.relu.default)
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce"]  # relu comes after the all_gather: left out


def test_graph_without_collectives_is_untouched():
    def f(x, w):
        return llama_norm(torch.relu(x) * 2.0 + x, w)
    gm = export(f, rand(4, 16), rand(16, seed=1))
    before = [(n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes]
    code = gm.code
    assert fuse(gm) == []
    assert [(n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes] == before
    assert gm.code == code


# ---- flags ------------------------------------------------------------------------------------

def _chain(x, residual, w):
    h = ar(torch.relu(x) * 0.5) + residual
    return torch.relu(torch_norm(h, w)) * 2.0


def _chain_args():
    return rand(4, 16), rand(4, 16, seed=1), rand(16, seed=2)


def test_fusion_disabled_leaves_the_graph_unfused():
    gm = export(_chain, *_chain_args())
    code = gm.code
    assert fuse(gm, enable_custom_op_fusion=False) == []
    assert gm.code == code and FUSED not in [n.target for n in gm.graph.nodes]


def test_recording_lists_each_graph_the_pass_runs_on():
    graphs_before = idc.stats["graphs"]
    with idc.recording() as outer:
        with idc.recording() as inner:
            (sub,) = fuse(export(_chain, *_chain_args()))
        assert fuse(export(_chain, *_chain_args()), enable_custom_op_fusion=False) == []
    fuse(export(_chain, *_chain_args()))  # after both blocks: in neither
    assert idc.stats["graphs"] - graphs_before == 3
    assert inner == outer[:1] and len(outer) == 2
    fused, off = outer
    assert (fused.kind, fused.collectives, fused.native_sites) == ("forward", ("all_reduce",), 0)
    assert fused.site_ops() == [ops_of(sub)] and len(fused.sites) == 1
    # Fusion off: the graph is still seen, with its collective, and has no site.
    assert (off.kind, off.collectives, off.sites) == ("forward", ("all_reduce",), ())


@pytest.mark.parametrize("flags, expected", [
    ({}, ["relu", "scale", "all_reduce", "add_rms_norm", "relu", "scale"]),
    ({"max_fusion_depth": 2}, ["relu", "scale", "all_reduce", "add_rms_norm", "relu"]),
    ({"custom_op_fusion_types": ("epilogue",)}, ["all_reduce", "add_rms_norm", "relu", "scale"]),
    ({"custom_op_fusion_types": ("prologue",)}, ["relu", "scale", "all_reduce"]),
    ({"max_fusion_depth": 1}, ["scale", "all_reduce", "add_rms_norm"]),
    ({"max_fusion_depth": 0}, ["all_reduce"]),
])
def test_flags_shape_the_site(flags, expected):
    gm = export(_chain, *_chain_args())
    (sub,) = fuse(gm, **flags)
    assert ops_of(sub) == expected


# ---- user ops registered with infini_dist ------------------------------------------------------

@torch.library.custom_op("idtest::scaled_copy", mutates_args=())
def scaled_copy(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha


@scaled_copy.register_fake
def _(x, alpha):
    return torch.empty_like(x)


def _scaled_copy_ref(x, alpha):
    return x * alpha


def _scaled_copy_twice(x, alpha):
    return (x + x) * (alpha / 2)


op_registry.register_op("idtest::scaled_copy", _scaled_copy_ref,
                        implementations={"mul": _scaled_copy_ref, "twice": _scaled_copy_twice})


def test_registered_user_op_becomes_a_site_and_runs():
    def f(x, residual):
        return torch.relu(torch.ops.idtest.scaled_copy(x, 3.0)) + residual
    x, residual = rand(4, 16), rand(4, 16, seed=1)
    gm = export(f, x, residual)
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["idtest::scaled_copy", "relu", "add"]
    assert sub.nodes[0].attr_dict == {"alpha": 3.0}
    # No collective in it: the engine tunes it on this process alone.
    (out,) = gm(x, residual)
    torch.testing.assert_close(out, torch.relu(x * 3.0) + residual)
    assert runtime_op.decisions() and runtime_op.decisions()[-1]["op"].startswith("idtest::")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewritten_chains_compute_what_the_graph_did(dtype):
    """Every form's IR op and captured attributes, checked by running the rewritten graph. A
    user op anchors the site, so no process group is needed to run it."""
    def f(x, up, s, residual, w):
        h = torch.ops.idtest.scaled_copy(x, 3.0)
        a = F.gelu(F.gelu(F.silu(h) * up, approximate="tanh")) * s
        b = torch.sigmoid(torch.relu(a)) * 0.75 + residual
        return llama_norm(b, w, 1e-5), b
    args = (rand(4, 16, dtype=dtype), rand(4, 16, dtype=dtype, seed=1),
            rand(4, 16, dtype=dtype, seed=2), rand(4, 16, dtype=dtype, seed=3),
            rand(16, dtype=dtype, seed=4))
    gm = export(f, *args)
    (sub,) = fuse(gm, max_fusion_depth=10)
    assert ops_of(sub) == ["idtest::scaled_copy", "swiglu", "gelu", "gelu", "mul", "relu",
                           "sigmoid", "scale", "add_rms_norm"]
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}[dtype]
    for got, want in zip(gm(*args), f(*args)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_missing_decision_under_cuda_graph_capture_runs_the_baseline(monkeypatch, caplog):
    sub = SubGraph((OpNode("idtest::scaled_copy", ("x",), ("y",), {"alpha": 2.0}),
                    OpNode("relu", ("y",), ("z",))), ("x",), ("z",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = rand(4, 16)
    with caplog.at_level(logging.WARNING, logger="infini_dist"):
        (out,) = FUSED([x], sub.canonical())
    torch.testing.assert_close(out, torch.relu(x * 2.0))
    assert "before CUDA-graph capture" in caplog.text


# ---- the runtime op and installation ----------------------------------------------------------

def test_subgraph_text_round_trips_and_bad_text_is_refused():
    sub = SubGraph((OpNode("all_reduce", ("a", "b"), ("c", "d"), {"group_name": "7", "op": "sum"}),
                    OpNode("add_rms_norm", ("c", "d", "w"), ("e", "f"), {"eps": 1e-5}),
                    OpNode("gelu", ("e",), ("g",), {"approximate": "tanh"})),
                   ("a", "b", "w"), ("g", "f"))
    assert runtime_op.subgraph_from_text(sub.canonical()) == sub
    with pytest.raises(ValueError, match="canonical"):
        runtime_op.subgraph_from_text('{"nodes": []}')
    with pytest.raises(ValueError, match="canonical"):
        runtime_op.subgraph_from_text(sub.canonical().replace(":", ": "))


def test_fake_outputs_follow_the_subgraph():
    sub = SubGraph((OpNode("all_reduce", ("x",), ("y",), {"group_name": "g0", "op": "sum"}),
                    OpNode("add_rms_norm", ("y", "r", "w"), ("n", "s"), {"eps": 1e-6})),
                   ("x", "r", "w"), ("n", "s"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(3, 8, dtype=torch.bfloat16).t()  # a non-contiguous input
        outs = FUSED([x, torch.empty(8, 3, dtype=torch.bfloat16), torch.empty(3)], sub.canonical())
    assert [(tuple(o.shape), o.dtype, o.is_contiguous()) for o in outs] == \
        [((8, 3), torch.bfloat16, True)] * 2


def test_uuid_tracks_the_flags_it_reads():
    base = idc.FusionPass().uuid()
    assert isinstance(base, str) and base == idc.FusionPass().uuid()
    for flags in ({"max_fusion_depth": 1}, {"enable_custom_op_fusion": False},
                  {"custom_op_fusion_types": ("epilogue",)}, {"enable_recursive_fusion": False}):
        with infini_dist.config.patch(**flags):
            assert idc.FusionPass().uuid() != base
    with infini_dist.config.patch(benchmark_reps=3):  # not read by the pass
        assert idc.FusionPass().uuid() == base


class _UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass"


def _passes(value):
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _passes(v)]
    return _passes(list(value.passes)) if hasattr(value, "passes") else [value]


@pytest.fixture
def user_pass():
    """A user's post-grad pass in Inductor's config. Afterwards the config and enable()'s record
    are put back exactly (no monkeypatch: its undo on Inductor's config, after an enable() that
    was never disabled, left later tests without the pass they had set)."""
    from torch._inductor import config as inductor_config
    saved, record = inductor_config.post_grad_custom_post_pass, dict(idc._installed)
    user = _UserPass()
    inductor_config.post_grad_custom_post_pass = user
    yield user
    idc.disable()
    inductor_config.post_grad_custom_post_pass = saved
    idc._installed.clear()
    idc._installed.update(record)


def test_enable_chains_the_user_pass_and_disable_restores_it(user_pass):
    from torch._inductor import config as inductor_config
    idc.enable()
    installed = inductor_config.post_grad_custom_post_pass
    assert _passes(installed) == [user_pass, idc.passes.FUSION_PASS]
    idc.enable()  # idempotent
    assert inductor_config.post_grad_custom_post_pass is installed
    # Every element Inductor sees has a uuid: the FX graph cache stays on.
    for p in (installed if isinstance(installed, list) else [installed]):
        assert p.uuid() is not None
    options = idc.inductor_options()
    assert options["post_grad_custom_post_pass"] is installed  # already there: not doubled
    idc.disable()
    assert inductor_config.post_grad_custom_post_pass is user_pass
    idc.disable()  # idempotent
    assert inductor_config.post_grad_custom_post_pass is user_pass
    options = idc.inductor_options({"max_autotune": False})
    assert _passes(options["post_grad_custom_post_pass"]) == [user_pass, idc.passes.FUSION_PASS]
    assert options["max_autotune"] is False


def test_disable_takes_only_our_pass_out_of_what_was_set_since(user_pass):
    from torch._inductor import config as inductor_config
    other = _UserPass()
    for since in ([user_pass, idc.passes.FUSION_PASS, other],
                  idc._Chain(user_pass, idc.passes.FUSION_PASS, other)):
        idc.enable()
        inductor_config.post_grad_custom_post_pass = since
        idc.disable()
        assert _passes(inductor_config.post_grad_custom_post_pass) == [user_pass, other]
        inductor_config.post_grad_custom_post_pass = user_pass
    # A record left by an enable() whose config was put back behind its back restores nothing.
    idc.enable()
    inductor_config.post_grad_custom_post_pass = user_pass
    idc.disable()
    assert inductor_config.post_grad_custom_post_pass is user_pass


def test_chained_pass_runs_both_in_order(user_pass):
    chain = idc._Chain(user_pass, idc.passes.FUSION_PASS)
    gm = export(lambda x: torch.relu(ar(x)), rand(4, 16))
    chain(gm.graph)
    assert user_pass.calls == 1 and FUSED in [n.target for n in gm.graph.nodes]
    assert idc._Chain(user_pass, lambda g: None).uuid() is None  # a bare callable: not cacheable


def test_subprocess_compile_mode_is_named_as_the_reason_nothing_fuses(monkeypatch, caplog):
    # Under TORCHINDUCTOR_FX_COMPILE_MODE=subprocess Inductor's child gets its config without the
    # custom post-grad passes (checked on torch 2.13: the pass never ran), so the pass says so
    # once, at enable() or inductor_options(); in the normal mode it says nothing.
    from torch._inductor import compile_fx
    idc._check_compile_mode.cache_clear()
    with caplog.at_level(logging.WARNING, logger="infini_dist"):
        idc.inductor_options()
    assert "FX_COMPILE_MODE" not in caplog.text
    idc._check_compile_mode.cache_clear()
    monkeypatch.setattr(compile_fx, "fx_compile_mode", compile_fx.FxCompileMode.SUBPROCESS)
    with caplog.at_level(logging.WARNING, logger="infini_dist"):
        idc.inductor_options()
        idc.enable()
        idc.disable()
    assert caplog.text.count("TORCHINDUCTOR_FX_COMPILE_MODE") == 1
    idc._check_compile_mode.cache_clear()


def test_compile_model_rejects_unknown_backends():
    with pytest.raises(ValueError, match="backend"):
        idc.compile_model(torch.nn.Linear(2, 2), backend="eager")
    with pytest.raises(ValueError, match="Inductor"):
        idc.compile_model(torch.nn.Linear(2, 2), backend="infini_dist", mode="max-autotune")
    assert "infini_dist" in torch._dynamo.list_backends()


def test_a_second_wait_on_the_reduced_value_is_absorbed():
    def f(x):  # dynamo's trace of funcol code that waits explicitly looks like this
        return torch.relu(c10d.wait_tensor(ar(x)))
    gm = export(f, rand(4, 16))
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "relu"]
    assert c10d.wait_tensor.default not in [n.target for n in gm.graph.nodes]
