"""The native choice: the user's own path (torch.distributed + eager torch ops, or Inductor's code
for a compiled site) is what the engine falls back to and what a fused choice must beat by
`fusion_speedup_threshold`; the fp32 reference only checks outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multirank import run_ranks
from infini_dist.scheduler import op_registry

EPS = 1e-6


def _tensors(dtype, rows=3, cols=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2)], \
        (torch.rand(cols, generator=g) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_ops_are_torchs_own_ops_in_the_input_dtype(dtype):
    (a, b), w = _tensors(dtype)

    def native(op, *tensors, **attrs):
        return op_registry.run_node(op, list(tensors), attrs, native=True)

    h = a + b
    expected = {
        "add": ((a, b), {}, (a + b,)),
        "mul": ((a, b), {}, (a * b,)),
        "scale": ((a,), {"scale": 0.5}, (a * 0.5,)),
        "relu": ((a,), {}, (torch.relu(a),)),
        "silu": ((a,), {}, (F.silu(a),)),
        "gelu": ((a,), {"approximate": "tanh"}, (F.gelu(a, approximate="tanh"),)),
        "sigmoid": ((a,), {}, (torch.sigmoid(a),)),
        "swiglu": ((a, b), {}, (F.silu(a) * b,)),
        "rms_norm": ((a, w), {"eps": EPS}, (F.rms_norm(a, (16,), w, EPS),)),
        "add_rms_norm": ((a, b, w), {"eps": EPS}, (F.rms_norm(h, (16,), w, EPS), h)),
    }
    for op, (tensors, attrs, want) in expected.items():
        got = native(op, *tensors, **attrs)
        assert len(got) == len(want), op
        for g, e in zip(got, want):
            assert g.dtype == dtype and torch.equal(g, e), op
        # and within the tolerance of the fp32 reference every choice is checked against
        for g, r in zip(got, op_registry.run_node(op, list(tensors), attrs)):
            assert op_registry.close_enough(g, r), op


def test_native_rms_norm_keeps_the_input_dtype_with_another_weight_dtype():
    (a, _), w = _tensors(torch.bfloat16)
    out = op_registry.run_node("rms_norm", [a, w.float()], {"eps": EPS}, native=True)[0]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.rms_norm(a, (16,), w, EPS))


def test_user_ops_run_their_reference_natively_unless_given_a_native_implementation():
    def ref(x):
        return x.float().exp().to(x.dtype)

    def mine(x):
        return torch.exp(x)

    plain = op_registry.register_op("test_native_exp_plain", ref, kind="elementwise", replace=True)
    own = op_registry.register_op("test_native_exp_own", ref, kind="elementwise", native=mine,
                          replace=True)
    assert plain.native is None and own.native is mine
    (a, _), _ = _tensors(torch.bfloat16)
    run_native = op_registry.run_node
    assert torch.equal(run_native("test_native_exp_plain", [a], {}, native=True)[0], ref(a))
    assert torch.equal(run_native("test_native_exp_own", [a], {}, native=True)[0], mine(a))
    with pytest.raises(TypeError, match="native must be callable"):
        op_registry.register_op("test_native_bad", ref, native=3, replace=True)


# ---- eager sites on 2 gloo ranks ----------------------------------------------------------------

def _rank_inputs(rank, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(10 + rank)
    shared = torch.Generator().manual_seed(7)  # replicated side tensors, as under TP
    return (torch.randn(4, 32, generator=g).to(dtype), torch.randn(4, 32, generator=shared).to(dtype),
            (torch.rand(32, generator=shared) + 0.5).to(dtype))


def _slow_fused(medians):
    return {n: t * (1.0 if n == "native" else 1e3) for n, t in medians.items()}


def _fixed_times(medians):
    # native 10, every other choice 9: only a threshold at or below 10/9 lets one win
    return {n: 10.0 if n == "native" else 9.0 for n in medians}


def eager_native_rank(rank, world_size):
    import torch.distributed as dist

    import infini_dist
    from infini_dist.ops import all_reduce_add_rms_norm, decisions
    from infini_dist.scheduler.store import STORE

    x, residual, weight = _rank_inputs(rank)
    torch_y = x.clone()
    dist.all_reduce(torch_y)
    torch_h = torch_y + residual
    torch_out = F.rms_norm(torch_h, (32,), weight, EPS)
    result = {}
    STORE.timing_hook = _slow_fused
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
            out, h = all_reduce_add_rms_norm(x, residual, weight, eps=EPS)
            result["slow_fused"] = decisions()[0]
            result["same_as_torch"] = torch.equal(out, torch_out) and torch.equal(h, torch_h)
        STORE.timing_hook = _fixed_times
        for threshold in (1.2, 1.1):
            with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2,
                                          fusion_speedup_threshold=threshold):
                out, _ = all_reduce_add_rms_norm(x, residual, weight, eps=EPS)
                result[threshold] = decisions()[0]["choice"]
                result[f"out {threshold}"] = out
    finally:
        STORE.timing_hook = None
    return result


def test_eager_sites_commit_native_unless_a_fused_choice_beats_it_by_the_threshold():
    r0, r1 = run_ranks(eager_native_rank, 2, timeout=180)
    for r in (r0, r1):
        record = r["slow_fused"]
        assert record["choice"] == "native" and record["native"] == "eager"
        assert record["candidates"][0] == "native" and len(record["candidates"]) > 1
        assert not {"unfused", "reference"} & set(record["times_s"])  # never timed
        assert r["same_as_torch"]  # bitwise: native is torch's own path
        assert r[1.2] == "native"  # 10 / 9 < 1.2
        assert r[1.1] != "native" and r[1.1] in record["candidates"]  # 10 / 9 >= 1.1
    assert torch.equal(r0["out 1.1"], r1["out 1.1"])


# ---- a compiled site: native is Inductor's code ---------------------------------------------------

def _committed_choices() -> list:
    """The choices every compiled site of this process committed, per signature."""
    from infini_dist.scheduler.store import STORE
    runners = [r for _, _, e in STORE.site_executors() for r in e.site_runners()]
    return [c for r in runners for c in r._committed.values()]


def compiled_native_rank(rank, world_size):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.native_inductor import InductorNativeChoice, epilogues_compiled

    group_name = dist.group.WORLD.group_name

    def block(x, residual, weight):
        h = funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name)) + residual
        return F.rms_norm(h, (32,), weight, EPS), h

    x, residual, weight = (t.float() for t in _rank_inputs(rank))
    STORE.timing_hook = _slow_fused
    compiled_before = epilogues_compiled()
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
            compiled = torch.compile(block, options=idc.inductor_options())
            out, h = compiled(x, residual, weight)
            again, _ = compiled(x, residual, weight)
            after_again = epilogues_compiled()
            compiled(x, residual, weight)
    finally:
        STORE.timing_hook = None
    (record,) = [d for d in idc.decisions() if d["op"] == "all_reduce+add+rms_norm"
                 or "rms_norm" in d["op"]]
    committed = _committed_choices()
    eager_out, eager_h = block(x, residual, weight)
    return {"record": record, "out": out, "again": again,
            "committed_inductor": [isinstance(c, InductorNativeChoice) and c.uses_inductor
                                   for c in committed],
            "epilogues": after_again - compiled_before,
            "epilogues_steady": epilogues_compiled() - after_again,
            "err": float((out - eager_out).abs().max()), "err_h": float((h - eager_h).abs().max())}


def partial_epilogue_rank(rank, world_size):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.native_inductor import InductorSteps

    group_name = dist.group.WORLD.group_name

    def block(x, residual, weight):
        h = funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name)) + residual
        return torch.relu(F.rms_norm(h, (32,), weight, EPS)) * 2.0, h

    x, residual, weight = (t.float() for t in _rank_inputs(rank))
    # The fused span takes the all_reduce and the add; the rms_norm is the unfused rest.
    STORE.timing_hook = lambda medians: {n: 1.0 if n == "torch_fused[p0,e1]" else 1e3
                                         for n in medians}
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
            compiled = torch.compile(block, options=idc.inductor_options())
            out, h = compiled(x, residual, weight)
            again, _ = compiled(x, residual, weight)
    finally:
        STORE.timing_hook = None
    committed = _committed_choices()
    rests = [[type(p).__name__, p.uses_inductor] for c in committed for k, p in c.steps
             if k == "inductor" and isinstance(p, InductorSteps)]
    eager_out, eager_h = block(x, residual, weight)
    return {"choices": [c.name for c in committed], "rests": rests, "out": out, "again": again,
            "err": float((out - eager_out).abs().max()), "err_h": float((h - eager_h).abs().max())}


def test_compiled_site_runs_a_partial_epilogue_choices_rest_as_inductor_compiles_it():
    env = {"INFINI_DIST_BENCHMARK_REPS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    r0, r1 = run_ranks(partial_epilogue_rank, 2, env=env, timeout=300)
    for r in (r0, r1):
        assert r["choices"] == ["torch_fused[p0,e1]"]
        assert r["rests"] == [["InductorSteps", True]]
        assert r["err"] < 1e-5 and r["err_h"] < 1e-5
        assert torch.equal(r["out"], r["again"])
    assert torch.equal(r0["out"], r1["out"])


def test_compiled_site_native_is_inductors_epilogue():
    env = {"INFINI_DIST_BENCHMARK_REPS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    r0, r1 = run_ranks(compiled_native_rank, 2, env=env, timeout=300)
    for r in (r0, r1):
        record = r["record"]
        assert record["choice"] == "native" and record["native"] == "inductor"
        assert "native" in record["candidates"] and len(record["candidates"]) > 1
        assert r["committed_inductor"] == [True]
        # Compiled at tune time, and again once per tensor dispatch-key set the tuning thread
        # and the graph hand it (Dynamo guards on those); then reused with no compile.
        assert 1 <= r["epilogues"] <= 3 and r["epilogues_steady"] == 0
        assert r["err"] < 1e-5 and r["err_h"] < 1e-5
        assert torch.equal(r["out"], r["again"])
    assert torch.equal(r0["out"], r1["out"])


# ---- the compiled-site native choice's fallbacks (single process, nothing reaches Inductor) ----

def _custom_anchor_site(epilogue_op):
    from infini_dist.scheduler.ir import OpNode, SubGraph
    from infini_dist.scheduler.boundary import find_sites
    op_registry.register_op("test_native_matmul", lambda a, b: a @ b, num_inputs=2,
                    implementations={"mm": torch.mm}, replace=True)
    graph = SubGraph((OpNode("test_native_matmul", ("a", "b"), ("c",)),
                      OpNode(epilogue_op, ("c",), ("d",)),
                      OpNode("scale", ("d",), ("e",), {"scale": 3.0})), ("a", "b"), ("e",))
    (site,) = find_sites(graph)
    g = torch.Generator().manual_seed(3)
    inputs = {"a": torch.randn(4, 8, generator=g), "b": torch.randn(8, 8, generator=g)}
    return graph, site, inputs


def _compiled_native(graph, site, inputs):
    from infini_dist.scheduler.choices import RunContext, TensorMeta, native_choice, run_nodes
    ctx = RunContext(None, 1, 0, torch.device("cpu"))
    env = dict(inputs)
    run_nodes(graph, site.region, env, ctx, native=True)
    choice = native_choice(graph, site, compiled=True)
    choice.precompile({n: TensorMeta.of(v) for n, v in env.items()}, ctx)
    return choice, env["e"]


def test_compiled_native_that_cannot_compile_runs_eager_torch_once_warned(caplog):
    def breaks_graph(x):
        torch._dynamo.graph_break()  # fullgraph=True refuses this before Inductor sees it
        return torch.relu(x)

    op_registry.register_op("test_native_breaks", breaks_graph, kind="elementwise", replace=True)
    graph, site, inputs = _custom_anchor_site("test_native_breaks")
    choice, expected = _compiled_native(graph, site, inputs)
    assert choice.name == "native" and choice.uses_inductor
    with caplog.at_level("WARNING", logger="infini_dist"):
        out = choice.run(inputs)["e"]
    assert torch.equal(out, expected)
    assert not choice.uses_inductor and "could not compile" in caplog.text
    again, _ = _compiled_native(graph, site, inputs)  # the failure is remembered: no retry
    assert not again.uses_inductor and torch.equal(again.run(inputs)["e"], expected)


def test_compiled_native_never_compiles_under_cuda_graph_capture(monkeypatch):
    from infini_dist.scheduler import native_inductor
    graph, site, inputs = _custom_anchor_site("relu")
    choice, expected = _compiled_native(graph, site, inputs)

    def must_not_run(*values):
        raise AssertionError("compiled under capture")
    monkeypatch.setattr(choice.epilogue, "_compiled", must_not_run)
    monkeypatch.setattr(native_inductor, "_capturing", lambda: True)
    assert torch.equal(choice.run(inputs)["e"], expected)  # eager torch instead


def test_partial_epilogue_choices_run_their_rest_compiled_only_in_a_compiled_site():
    from infini_dist.scheduler.choices import RunContext, TensorMeta, generate_choices, run_nodes
    from infini_dist.scheduler.native_inductor import epilogues_compiled
    graph, site, inputs = _custom_anchor_site("relu")
    ctx = RunContext(None, 1, 0, torch.device("cpu"))
    env = dict(inputs)
    run_nodes(graph, site.region, env, ctx, native=True)
    meta = {n: TensorMeta.of(v) for n, v in env.items()}
    for compiled in (False, True):
        choices = generate_choices(graph, site, meta, ctx, fusion_types=["epilogue"],
                                   max_depth=2, recursive=True, compiled=compiled)
        rests = {}
        for choice in choices[1:]:
            before = epilogues_compiled()
            choice.precompile(meta, ctx)
            out = choice.run(inputs)["e"]
            torch.testing.assert_close(out, env["e"])
            rests[choice.name] = ([len(p.indices) for k, p in choice.steps if k == "inductor"],
                                  epilogues_compiled() - before)
        if compiled:  # e0: relu and scale compiled, e1: scale, e2: nothing left
            assert rests == {"impl:mm[p0,e0]": ([2], 1), "impl:mm[p0,e1]": ([1], 1),
                             "impl:mm[p0,e2]": ([], 0)}
        else:
            assert all(r == ([], 0) for r in rests.values()) and len(rests) == 3
