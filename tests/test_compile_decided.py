"""A graph compiled again after its sites decided: a site decided native is Inductor's own code,
and one decided bare (our collective, nothing fused) is cut down to its collective alone (that
bare site decides in turn). 2 gloo ranks; the timing hook fixes who wins."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from multirank import run_ranks
from test_compile_tp import _ar, _one_compile_thread
from test_native import EPS, _slow_fused


def _bare_fastest(medians):
    return {n: 1.0 if n.startswith("bare") else 10.0 for n in medians}


def _bare_algorithm():
    """Our all_reduce alone, every other op of the site in eager torch: a choice that fuses
    nothing yet is not native."""
    import torch.distributed as dist

    from infini_dist.scheduler.choices import Algorithm

    class Bare(Algorithm):
        name = "bare"

        def supports(self, span, meta, ctx):
            return not span.fuses_anything

        def compile(self, span, meta, ctx):
            anchor = span.graph.nodes[span.anchors[0]]

            def run(env):
                y = env[anchor.inputs[0]].clone()
                dist.all_reduce(y, group=ctx.group)
                return {anchor.outputs[0]: y}
            return run
    return Bare()


def _compile_and_run(block, args):
    """(outputs, sites replaced, sites left native, site texts) of one fresh compile."""
    import infini_dist.compile as idc
    torch._dynamo.reset()
    sites, native = idc.stats["sites"], idc.stats["native_sites"]
    out = idc.compile_model(block)(*args)
    return out, idc.stats["sites"] - sites, idc.stats["native_sites"] - native, \
        list(idc.last_sites)


def recompile_rank(rank, world_size):
    import torch.distributed as dist

    import infini_dist
    from infini_dist.scheduler.ir import subgraph_from_text
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.choices import register_algorithm

    _one_compile_thread()
    group = dist.group.WORLD.group_name

    def block(x, residual, weight):
        h = _ar(x, group) + residual
        return F.rms_norm(h, (32,), weight, EPS), h

    def inputs(rows):  # rows differ per scenario: each its own token bucket, decided afresh
        own, shared = (torch.Generator().manual_seed(s) for s in (10 + rank, 7))
        return (torch.randn(rows, 32, generator=own), torch.randn(rows, 32, generator=shared),
                torch.rand(32, generator=shared) + 0.5)

    from infini_dist.compile.passes import FUSION_PASS
    result = {"uuid_before": FUSION_PASS.uuid()}
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
            STORE.timing_hook = _slow_fused
            args = inputs(4)
            result["native"] = [_compile_and_run(block, args) for _ in range(3)]
            result["uuid_after"] = FUSION_PASS.uuid()  # FX graph cache: graphs kept apart
            result["native_eager"] = block(*args)
            register_algorithm("all_reduce", "cpu", _bare_algorithm())
            STORE.timing_hook = _bare_fastest
            args = inputs(16)
            result["bare"] = [_compile_and_run(block, args) for _ in range(2)]
            result["bare_eager"] = block(*args)
    finally:
        STORE.timing_hook = None
    for key in ("native", "bare"):  # site texts -> their ops, for the assertions
        result[key] = [(out, sites, native, ["+".join(n.op_type for n in
                                                       subgraph_from_text(t).nodes)
                                              for t in texts])
                       for out, sites, native, texts in result[key]]
    return result


def _close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(a, b))


def test_recompiled_sites_follow_their_decisions():
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    r0, r1 = run_ranks(recompile_rank, 2, env=env, timeout=400)
    for r in (r0, r1):
        assert r["uuid_before"] != r["uuid_after"]
        # native wins the whole site, against our all_reduce alone too: then nothing of ours,
        # the graph is Inductor's own.
        counts = [(sites, native, ops) for _, sites, native, ops in r["native"]]
        assert counts == [(1, 0, ["all_reduce+add_rms_norm"]), (0, 1, []), (0, 1, [])]
        # our bare all_reduce wins: the site is cut to it, and it stays (it is not native).
        counts = [(sites, native, ops) for _, sites, native, ops in r["bare"]]
        assert counts == [(1, 0, ["all_reduce+add_rms_norm"]), (1, 0, ["all_reduce"])]
        for key in ("native", "bare"):
            for out, *_ in r[key]:
                assert _close(out, r[f"{key}_eager"])
    for key in ("native", "bare"):
        for (a, *_), (b, *_) in zip(r0[key], r1[key]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_decision_rewrites_the_site_where_it_leaves_ops_to_inductor():
    from infini_dist.scheduler.store import Decision

    native, bare, fused = (Decision("native", True), Decision("two_shot[p0,e0]", True),
                           Decision("two_shot[p0,e1]", False))
    # The pass's choice of form (decided.written) and the recompiler's digest read this rule.
    assert native.rewrites(True) and native.rewrites(False)
    assert bare.rewrites(True) and not bare.rewrites(False)  # a lone collective stays ours
    assert not fused.rewrites(True) and not fused.rewrites(False)
    assert native.native and not bare.native


def run_time_attribute_rank(rank, world_size):
    """A site whose eps the graph reads from a 0-dim CPU tensor (scheduler/run_time_attrs.py),
    decided native: compiled again, the pass knows it by the one value it ran with."""
    import torch.distributed as dist

    import infini_dist
    from infini_dist.scheduler.store import STORE
    _one_compile_thread()
    group = dist.group.WORLD.group_name

    def block(x, residual, weight, eps):  # HF's RMSNorm spelling, eps a tensor
        h = _ar(x, group) + residual
        f = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * f, h

    own, shared = (torch.Generator().manual_seed(s) for s in (10 + rank, 7))
    args = (torch.randn(8, 32, generator=own), torch.randn(8, 32, generator=shared),
            torch.rand(32, generator=shared) + 0.5, torch.tensor(1e-5, dtype=torch.float64))
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
            STORE.timing_hook = _slow_fused
            runs = [_compile_and_run(block, args) for _ in range(2)]
    finally:
        STORE.timing_hook = None
    return {"counts": [(sites, native) for _, sites, native, _ in runs],
            "close": [_close(out, block(*args)) for out, *_ in runs]}


def test_a_site_with_a_run_time_attribute_follows_its_decision():
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    for r in run_ranks(run_time_attribute_rank, 2, env=env, timeout=400):
        assert r["counts"] == [(1, 0), (0, 1)]  # then Inductor's own code, which reads eps
        assert all(r["close"])
