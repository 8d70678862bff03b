"""The seed scheduler API (infini_dist.fusion) when a fused choice fails: fallback to the
unfused graph with a warning, the errors that must not fall back, debug logs, and on 2 ranks,
a fallback only when every rank failed.
"""

import logging

import pytest
import torch

import infini_dist
from infini_dist.fusion import FusionConfig, FusionScheduler, OpNode, SubGraph
from infini_dist.scheduler.store import STORE
from infini_dist.scheduler.control import ControlPlaneError

from fusion_api_ops import (FLAKY, assert_correct, prefer_fused,  # noqa: F401 - fixtures
                            sample, setup_ops_and_fast_tuning, triple_flaky, triple_reference,
                            triple_relu_graph)
from multirank import run_ranks

# ---- fallback and debug logs ---------------------------------------------------------------------

def break_after_tuning(scheduler, graph, x, error):
    """Tune (every choice works), then make the flaky implementation raise from now on."""
    assert_correct(scheduler.dispatch(graph, {"x": x}), x)
    FLAKY["error"] = error


def flaky_only_graph():
    # Only the flaky implementation: the committed choice is certain to use it.
    FusionScheduler().register_op("fusion_api_triple_flaky", triple_reference,
                                  implementations={"flaky": triple_flaky})
    return SubGraph((OpNode("fusion_api_triple_flaky", ("x",), ("tripled",)),
                     OpNode("relu", ("tripled",), ("output",))), ("x",), ("output",))


def test_fallback_on_error_warns_and_runs_unfused(prefer_fused, caplog):
    scheduler = FusionScheduler(FusionConfig(debug_mode=True))
    graph, x = flaky_only_graph(), sample()
    break_after_tuning(scheduler, graph, x, RuntimeError("kernel exploded"))
    with caplog.at_level(logging.DEBUG, logger="infini_dist"):
        with pytest.warns(RuntimeWarning, match="kernel exploded.*running it unfused"):
            out = scheduler.dispatch(graph, {"x": x})
    assert_correct(out, x)
    assert scheduler.get_cache_stats()["fallbacks"] == 1
    assert any("fallback" in r.getMessage() and "kernel exploded" in r.getMessage()
               for r in caplog.records)
    FLAKY["error"] = None  # the fused path works again: no more fallbacks
    assert_correct(scheduler.dispatch(graph, {"x": x}), x)
    assert scheduler.get_cache_stats()["fallbacks"] == 1


@pytest.mark.parametrize("fallback_on_error, error", [
    (False, RuntimeError("kernel exploded")),
    (True, ControlPlaneError("rank 1 never arrived")),  # a cross-rank failure is never swallowed
], ids=["fallback_disabled", "control_plane_error"])
def test_errors_that_must_not_fall_back(prefer_fused, fallback_on_error, error):
    scheduler = FusionScheduler(FusionConfig(fallback_on_error=fallback_on_error))
    graph, x = flaky_only_graph(), sample()
    break_after_tuning(scheduler, graph, x, error)
    with pytest.raises(type(error), match=str(error)):
        scheduler.dispatch(graph, {"x": x})
    assert scheduler.get_cache_stats()["fallbacks"] == 0


def test_debug_mode_logs_routing_tuning_and_cache_hits(caplog):
    scheduler = FusionScheduler(FusionConfig(debug_mode=True))
    graph, x = triple_relu_graph(), sample()
    with caplog.at_level(logging.DEBUG, logger="infini_dist"):
        scheduler.dispatch(graph, {"x": x})
        first = [r.getMessage() for r in caplog.records if r.name == "infini_dist"]
        caplog.clear()
        scheduler.dispatch(graph, {"x": x})
        second = [r.getMessage() for r in caplog.records if r.name == "infini_dist"]
    assert any("routed graph" in m and "fused" in m for m in first)
    assert any("tuned (compiled and benchmarked) 1 site" in m for m in first)
    assert any("cache hit" in m for m in second)
    assert not any("routed graph" in m or "tuned" in m for m in second)

    caplog.clear()
    quiet = FusionScheduler()
    with caplog.at_level(logging.DEBUG, logger="infini_dist"):
        quiet.dispatch(graph, {"x": sample(seed=3)})
    assert not [r for r in caplog.records if "infini_dist.fusion" in r.getMessage()]


# ---- fallback across ranks -------------------------------------------------------------------------

def flaky_all_reduce_rank(rank, world_size):
    """all_reduce -> relu -> scale through a fused CPU algorithm that, once tuned, fails after
    its collective on the ranks in `failing`. Phase 1: every rank fails. Phase 2: rank 0 only,
    and only once rank 1 has finished its call and abandoned its control planes (as a rank that
    moves on to its shutdown does), so rank 0's vote must rebuild the plane and time out there.
    Returns, per phase, what the dispatch produced or raised."""
    import warnings

    import torch.distributed as dist

    from infini_dist.scheduler.control import reset_control_planes
    store = dist.distributed_c10d._get_default_store()

    from infini_dist.fusion.patterns import create_all_reduce_relu_scale_pattern
    from infini_dist.scheduler.choices import register_algorithm, unregister_algorithm
    from infini_dist.scheduler.torch_fused import TorchFusedAllReduce

    failing = set()

    class BreaksLater(TorchFusedAllReduce):
        name = "breaks_later"

        def compile(self, span, meta, ctx):
            run = super().compile(span, meta, ctx)

            def run_then_fail(env):
                out = run(env)  # fail after the collective: the hardest case to recover from
                if ctx.rank in failing:
                    if len(failing) < world_size:
                        store.wait(["peer moved on"])
                    raise RuntimeError(f"injected failure on rank {ctx.rank}")
                return out
            return run_then_fail

    unregister_algorithm("all_reduce", "cpu", "torch_fused")
    register_algorithm("all_reduce", "cpu", BreaksLater())
    STORE.timing_hook = lambda medians: {n: t * (1e3 if n == "native" else 1.0)
                                          for n, t in medians.items()}
    xs = [torch.randn(8, 256, generator=torch.Generator().manual_seed(10 + r))
          for r in range(world_size)]
    scheduler = FusionScheduler()
    results = []
    with infini_dist.config.patch(benchmark_reps=2, benchmark_warmup=1, tuning_timeout_s=30.0):
        for scale, failing_ranks in ((0.5, {0, 1}), (0.25, {0})):
            graph = create_all_reduce_relu_scale_pattern(scale=scale)  # a new graph: tuned anew
            expected_out = torch.relu(sum(x.double() for x in xs)) * scale
            result = {}
            failing.clear()
            first = scheduler.dispatch(graph, {"x": xs[rank]})
            result["tuned_error"] = float((first["output"].double() - expected_out).abs().max())
            failing.update(failing_ranks)
            fallbacks = scheduler.get_cache_stats()["fallbacks"]
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = scheduler.dispatch(graph, {"x": xs[rank]})
                result["error"] = float((out["output"].double() - expected_out).abs().max())
                result["warned"] = any("injected failure" in str(w.message) for w in caught)
                if failing_ranks != set(range(world_size)):
                    reset_control_planes()
                    store.set("peer moved on", "1")
            except Exception as error:  # noqa: BLE001 - reported to the test
                result["raised"] = f"{type(error).__name__}: {error}"
            result["fallbacks"] = scheduler.get_cache_stats()["fallbacks"] - fallbacks
            results.append(result)
    return results


def test_fallback_across_ranks_needs_every_rank_to_fail():
    both, only_rank0 = zip(*run_ranks(flaky_all_reduce_rank, 2))
    # Every rank fails after the all_reduce: all fall back together and re-reduce correctly.
    for rank in both:
        assert rank["tuned_error"] < 1e-5 and rank["error"] < 1e-5 and rank["warned"], rank
        assert rank["fallbacks"] == 1
    # Only rank 0 fails: its fallback all_reduce would pair with nothing (or with rank 1's next
    # call), so it must raise a control-plane error instead; rank 1 has its correct result.
    assert only_rank0[0]["raised"].startswith("ControlPlaneError"), only_rank0[0]
    assert "injected failure" in only_rank0[0]["raised"] and "error" not in only_rank0[0]
    assert only_rank0[0]["fallbacks"] == 0
    assert only_rank0[1]["error"] < 1e-5 and not only_rank0[1]["warned"]
