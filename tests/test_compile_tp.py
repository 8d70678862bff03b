"""The compile pass end to end on 2 gloo ranks: a Llama-style block sharded with torch's tensor
parallelism and compiled by Inductor, hand-written funcol collectives, and the infini_dist
backend (the pass without Inductor). Compiled outputs must match the uncompiled model.

Inductor's C++ compile is the slow part, so there are two Inductor compiles in all. The ranks
share the session's Inductor code cache (tests/conftest.py), FX graph cache off, except in the
test of what that cache serves: each of its ranks has a cache dir of its own.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from multirank import run_ranks
from test_native import _fixed_times

FAST_TUNING = {"INFINI_DIST_BENCHMARK_REPS": "2", "INFINI_DIST_BENCHMARK_WARMUP": "1",
               "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _env():
    return dict(FAST_TUNING)


def _one_compile_thread():
    """Inductor compiles on this rank's thread. Its cache dir is the session's (conftest.py):
    compiled code is shared, the FX graph cache is off, so the pass runs on every graph."""
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = 1


def _fx_graph_cache_env(tmp_path):
    """Settings for ranks that use Inductor's FX graph and AOTAutograd caches (off in the rest of
    the session; Inductor reads them at import), each rank in a cache dir of its own
    (_own_inductor_cache): ranks compile identical graphs, so with one dir a rank may hit the
    entry another just wrote and never run the pass itself."""
    return dict(FAST_TUNING, INDUCTOR_CACHE_BASE=str(tmp_path / "inductor"),
                TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")


def _own_inductor_cache(rank):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["INDUCTOR_CACHE_BASE"],
                                                         f"rank{rank}")
    _one_compile_thread()


def _ar(x, group_name):
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _rel_diff(a, b) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs() / (1 + b.abs())).max())


# ---- a tensor-parallel block through Inductor ---------------------------------------------------

def sharded_block(rank, world):
    """(the full block, its tensor-parallel shard, an input): the same full weights and input
    on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import tp_block
    _one_compile_thread()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = tp_block.Block()
    return full, tp_block.shard(copy.deepcopy(full), mesh), torch.randn(2, 4, 16)


def tp_block_rank(rank, world):
    from torch._dynamo.utils import counters

    import infini_dist.compile as idc
    from infini_dist.scheduler.store import STORE
    _own_inductor_cache(rank)  # before any compile: the FX graph cache is what this test checks
    full, block, x = sharded_block(rank, world)
    # Fused choices win: a site decided native would be left to Inductor by the second compile
    # (compile/decided.py), a fused one leaves the FX graph cache key as it was.
    STORE.timing_hook = _fixed_times
    with torch.no_grad():
        reference, eager = full(x), block(x)
        out = idc.compile_model(block)(x)
        sites = list(idc.last_sites)
        replaced = idc.stats["sites"]
        decided = [(d["op"], d["choice"], d["source"]) for d in idc.decisions()]
        executed = sorted({text for text, _, _ in STORE.site_executors()})  # the sites that ran
        torch._dynamo.reset()  # compile again: Inductor's FX graph cache has it
        hits = counters["inductor"]["fxgraph_cache_hit"]
        with idc.recording() as recorded_after_hit:
            again = idc.compile_model(block)(x)
        hits = counters["inductor"]["fxgraph_cache_hit"] - hits
    return {"sites": sites, "executed": executed, "replaced": replaced,
            "replaced_after_hit": idc.stats["sites"], "recorded_after_hit": recorded_after_hit,
            "cache_hits": hits, "decided": decided, "tp_vs_full": _max_diff(eager, reference),
            "compiled_vs_eager": _max_diff(out, eager), "cached_vs_eager": _max_diff(again, eager)}


def test_tp_llama_block_compiled_with_inductor(tmp_path):
    from infini_dist.scheduler.ir import subgraph_from_text
    # the sites without the GEMM, whatever the environment sets (matmul_prologue has its tests)
    env = dict(_fx_graph_cache_env(tmp_path), INFINI_DIST_MATMUL_PROLOGUE="0")
    results = run_ranks(tp_block_rank, 2, env=env, timeout=240)
    for r in results:
        assert r["tp_vs_full"] < 1e-5  # the sharding itself is right
        assert r["replaced"] == 2  # wo and down: all_reduce -> add -> rms_norm each
        subs = [subgraph_from_text(t) for t in r["sites"]]
        assert [[n.op_type for n in s.nodes] for s in subs] == [["all_reduce", "add_rms_norm"]] * 2
        # After attention both the norm and the residual sum are read; at the end only the norm.
        assert [len(s.output_names) for s in subs] == [2, 1]
        assert [s.nodes[1].attr("eps") for s in subs] == pytest.approx([1e-5, 1e-6], rel=1e-6)
        assert r["executed"] == sorted(r["sites"])
        assert r["compiled_vs_eager"] < 1e-5
        # The engine tuned each site across the ranks and committed a choice.
        assert len(r["decided"]) == 2 and all(source == "tuned" for _, _, source in r["decided"])
        # The second compile came from the FX graph cache: the pass did not run again, and the
        # cached code still carries both sites.
        assert r["cache_hits"] >= 1 and r["replaced_after_hit"] == 2
        assert r["recorded_after_hit"] == []
        assert r["cached_vs_eager"] < 1e-5
    assert results[0]["sites"] == results[1]["sites"]  # identical on every rank
    assert results[0]["decided"] == results[1]["decided"]


# ---- hand-written funcol: prologue, all_reduce, relu * scale -------------------------------------

def funcol_rank(rank, world):
    import torch.distributed as dist

    import infini_dist.compile as idc
    _one_compile_thread()
    group = dist.group.WORLD.group_name

    def relu_scale(x):
        return torch.relu(_ar(torch.relu(x) * 0.5, group)) * 2.0

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    expected = sum(torch.relu(torch.randn(4, 16, generator=torch.Generator().manual_seed(r)))
                   for r in range(world)) * 0.5
    expected = torch.relu(expected) * 2.0
    with idc.recording() as graphs:
        out = idc.compile_model(relu_scale)(x)
    return {"sites": list(idc.last_sites), "graphs": graphs,
            "eager": _max_diff(relu_scale(x), expected), "compiled": _max_diff(out, expected)}


def test_funcol_prologue_and_relu_scale_compiled_with_inductor():
    from infini_dist.scheduler.ir import subgraph_from_text
    results = run_ranks(funcol_rank, 2, env=_env(), timeout=180)
    for r in results:
        (sub,) = [subgraph_from_text(t) for t in r["sites"]]
        assert [n.op_type for n in sub.nodes] == ["relu", "scale", "all_reduce", "relu", "scale"]
        (graph,) = r["graphs"]  # what recording() saw: the one forward graph, as compiled
        assert (graph.kind, graph.collectives, graph.sites) == ("forward", ("all_reduce",),
                                                                tuple(r["sites"]))
        assert graph.site_ops() == [["relu", "scale", "all_reduce", "relu", "scale"]]
        assert r["eager"] < 1e-6 and r["compiled"] < 1e-6


# ---- the infini_dist backend: coalesced all_reduces, bf16 norm, swiglu; flags off ----------------

def backend_rank(rank, world):
    import torch.distributed as dist

    import infini_dist
    import infini_dist.compile as idc
    group = dist.group.WORLD.group_name

    def block(x, y, residual, weight, up):
        a, b = _ar(x, group), _ar(y, group)  # independent: one site with both
        h = a + residual
        normed = F.rms_norm(h.float(), (h.shape[-1],), weight.float(), 1e-6).to(h.dtype)
        return normed, h, F.silu(b) * up

    def inputs(seed, *shape):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    args = (inputs(rank, 8, 32), inputs(10 + rank, 8, 32), inputs(20, 8, 32),
            inputs(21, 32) * 0.1 + 1, inputs(22, 8, 32))
    eager = block(*args)
    results = {}
    for name, flags in (("fused", {}), ("off", {"enable_custom_op_fusion": False})):
        torch._dynamo.reset()  # dynamo would reuse the frame compiled under other flags
        with infini_dist.config.patch(**flags):
            out = torch.compile(block, backend="infini_dist")(*args)
        results[name] = {"sites": list(idc.last_sites),
                         "diff": [_rel_diff(o, e) for o, e in zip(out, eager)],
                         "equal": [torch.equal(o, e) for o, e in zip(out, eager)]}
    return results


def test_backend_coalesces_and_obeys_the_flags():
    from infini_dist.scheduler.ir import subgraph_from_text
    results = run_ranks(backend_rank, 2, env=_env(), timeout=180)
    for r in results:
        (sub,) = [subgraph_from_text(t) for t in r["fused"]["sites"]]
        assert [n.op_type for n in sub.nodes] == ["all_reduce", "all_reduce", "add_rms_norm",
                                                  "swiglu"]
        # bf16 (8 bits): a rounding or two apart from eager, whichever choice was committed.
        assert max(r["fused"]["diff"]) < 2 ** -6
        assert r["off"]["sites"] == [] and all(r["off"]["equal"])
    assert results[0]["fused"] == results[1]["fused"]  # same sites, same (replicated) results
