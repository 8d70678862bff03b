"""Issue 12, inputs and routing: per-rank routing agreed, integer / 0-d / NaN inputs as torch does
them, register_op replacing a definition. Multi-rank cases run on 2 and 3 gloo ranks; each rank
reports (case, outcome, seconds) so docs/reliability.md can record them.
"""

from __future__ import annotations

import time

import pytest
import torch

import infini_dist
from infini_dist.fusion import FusionConfig, FusionScheduler, OpNode, SubGraph
from infini_dist.scheduler.op_registry import close_enough

from multirank import run_ranks

TIMEOUT_S = 20  # tuning_timeout_s in the multi-rank cases: every outcome must come well before


def partial(rank, *shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(*shape, generator=gen) * 3).to(dtype)


def outcome(fn, chars=160):
    """(outcome text, seconds): 'ok' or the exception's type and first `chars` characters."""
    started = time.perf_counter()
    try:
        fn()
        text = "ok"
    except Exception as error:  # noqa: BLE001 - the outcome is what we record
        text = f"{type(error).__name__}: {str(error)[:chars]}"
    return text, round(time.perf_counter() - started, 2)


def relu_scale_graph():
    return SubGraph((OpNode("all_reduce", ("x",), ("r",)), OpNode("relu", ("r",), ("a",)),
                     OpNode("scale", ("a",), ("out",), {"scale": 2.0})), ("x",), ("out",))


# ---- the eager ops on integer, 0-d and non-finite inputs ----------------------------------------

def eager_inputs_rank(rank, world):
    from infini_dist.ops import all_reduce_add_rms_norm, all_reduce_relu_scale
    report = {}

    def total(make):
        return sum(make(r) for r in range(world))

    def int_relu_scale():
        make = lambda r: torch.arange(-6, 10).reshape(4, 4) * (r + 1)  # noqa: E731
        out = all_reduce_relu_scale(make(rank), 2.5)
        want = torch.relu(total(make)) * 2.5  # torch: int relu stays int, x 2.5 is float
        assert out.dtype == want.dtype == torch.float32 and torch.equal(out, want), out

    def int_add_rms_norm():
        x = torch.arange(16).reshape(4, 4)
        all_reduce_add_rms_norm(x, x, torch.ones(4, dtype=torch.int64))

    def zero_d_relu_scale():
        out = all_reduce_relu_scale(torch.tensor(3.0 + rank), 2.0)
        want = torch.relu(torch.tensor(sum(3.0 + r for r in range(world)))) * 2.0
        assert out.shape == () and torch.equal(out, want), out

    def zero_d_add_rms_norm():
        all_reduce_add_rms_norm(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(1.0))

    def nan_inf_first_call(dtype):
        def make(r):
            x = partial(r, 8, 64, seed=3, dtype=dtype)
            if r == 0:
                x[1, 5], x[2, 7], x[6, 0] = float("nan"), float("inf"), float("-inf")
            return x
        reduced = total(lambda r: make(r).double())
        out = all_reduce_relu_scale(make(rank), 0.5)
        want = (torch.relu(reduced) * 0.5).to(dtype)
        assert torch.equal(out.isnan(), want.isnan()) and out.isnan().sum() == 1
        assert close_enough(out, want), (out - want).abs().nan_to_num().max()
        residual, weight = partial(9, 8, 64, dtype=dtype), partial(8, 64, dtype=dtype)
        normed, h = all_reduce_add_rms_norm(make(rank), residual, weight)
        bad_rows = torch.tensor([False, True, True] + [False] * 3 + [True, False])
        assert bool(normed[bad_rows].isnan().any(dim=-1).all())  # NaN spreads along its row
        assert bool(normed[~bad_rows].isfinite().all())

    for name, case in (("int64 relu*2.5", int_relu_scale), ("int64 add_rms_norm", int_add_rms_norm),
                       ("0-d relu*scale", zero_d_relu_scale),
                       ("0-d add_rms_norm", zero_d_add_rms_norm),
                       ("NaN/inf first call fp32", lambda: nan_inf_first_call(torch.float32)),
                       ("NaN/inf first call bf16", lambda: nan_inf_first_call(torch.bfloat16))):
        with infini_dist.config.patch(tuning_timeout_s=TIMEOUT_S, benchmark_warmup=1,
                                      benchmark_reps=2):
            report[name] = outcome(case)
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_integer_zero_d_and_nan_inputs_follow_torch(world):
    reports = run_ranks(eager_inputs_rank, world, timeout=240)
    for report in reports:
        assert report["int64 relu*2.5"][0] == "ok", report
        assert report["int64 add_rms_norm"][0].startswith("TypeError: rms_norm needs a floating")
        assert report["0-d relu*scale"][0] == "ok", report
        assert report["0-d add_rms_norm"][0].startswith("RuntimeError: rms_norm: Expected")
        assert report["NaN/inf first call fp32"][0] == "ok", report
        assert report["NaN/inf first call bf16"][0] == "ok", report
        assert all(seconds < TIMEOUT_S for _, seconds in report.values()), report


# ---- routing agreed across ranks -----------------------------------------------------------------

def routing_rank(rank, world):
    report = {}
    graph, big = relu_scale_graph(), (64, 32)  # 2048 elements: over min_tensor_size=1024

    def check(scheduler, shape):
        x = partial(rank, *shape, seed=5)
        out = scheduler.dispatch(graph, {"x": x})["out"]
        want = torch.relu(sum(partial(r, *shape, seed=5).double() for r in range(world))) * 2.0
        assert close_enough(out, want.float()), "wrong result"

    with infini_dist.config.patch(tuning_timeout_s=TIMEOUT_S, benchmark_warmup=1,
                                  benchmark_reps=2):
        scheduler = FusionScheduler()
        # Rank 0 alone under min_tensor_size: it would route unfused, the others fused.
        report["shapes differ, one under min_tensor_size"] = outcome(
            lambda: check(scheduler, (4, 4) if rank == 0 else big))
        report["same shapes after the mismatch"] = outcome(lambda: check(scheduler, big))
        report["same shapes, cached route"] = outcome(lambda: check(scheduler, big))
        # Same shapes, a per-rank switch: rank 1 has fusion off.
        off = FusionScheduler(FusionConfig(enable_fusion=rank != 1))
        report["fusion switch differs"] = outcome(lambda: check(off, big))
        with infini_dist.config.patch(enable_custom_op_fusion=rank != world - 1):
            report["global flag differs"] = outcome(lambda: check(FusionScheduler(), big))
        listed = FusionScheduler(FusionConfig(op_whitelist=None if rank else ("all_reduce",)))
        report["whitelist differs"] = outcome(lambda: check(listed, big))
        report["dtypes differ"] = outcome(lambda: FusionScheduler().dispatch(
            graph, {"x": partial(rank, *big, dtype=torch.float64 if rank else torch.float32)}))
        report["both under min_tensor_size, shapes differ"] = outcome(
            lambda: check(scheduler, (4, 4 + rank)))
        report["all agree at the end"] = outcome(lambda: check(FusionScheduler(), big))
    stats = scheduler.get_cache_stats()
    report["routes cached"] = (str(stats["size"]), 0.0)
    return report


def cached_on_one_rank(rank, world):
    """Rank 0 has the route of its signature cached; the others meet theirs for the first time."""
    graph, big = relu_scale_graph(), (64, 32)
    scheduler = FusionScheduler()
    with infini_dist.config.patch(tuning_timeout_s=5, benchmark_warmup=1, benchmark_reps=2):
        scheduler.dispatch(graph, {"x": partial(rank, *big)})
        return {"one rank's route cached": outcome(lambda: scheduler.dispatch(
            graph, {"x": partial(rank, *big, dtype=torch.float64 if rank else torch.float32)}))}


@pytest.mark.parametrize("world", [2, 3])
def test_a_signature_cached_on_one_rank_only_fails_everywhere_in_time(world):
    reports = run_ranks(cached_on_one_rank, world, timeout=120)
    for report in reports:
        text, seconds = report["one rank's route cached"]
        assert text.startswith(("ControlPlaneError", "RankMismatchError")), text
        assert seconds < 5 + 10


@pytest.mark.parametrize("world", [2, 3])
def test_per_rank_routing_decisions_are_agreed(world):
    reports = run_ranks(routing_rank, world, timeout=240)
    mismatches = ("shapes differ, one under min_tensor_size", "fusion switch differs",
                  "global flag differs", "whitelist differs", "dtypes differ",
                  "both under min_tensor_size, shapes differ")
    for report in reports:
        for case in mismatches:
            assert report[case][0].startswith("RankMismatchError"), (case, report[case])
            assert "step 'route'" in report[case][0]
        for case in ("same shapes after the mismatch", "same shapes, cached route",
                     "all agree at the end"):
            assert report[case][0] == "ok", (case, report[case])
        assert all(seconds < TIMEOUT_S for _, seconds in report.values()), report
        assert report["routes cached"][0] == "1"  # only the agreed route was kept
    assert "input shapes or dtypes" in reports[0]["shapes differ, one under min_tensor_size"][0]
    assert "routes" in reports[0]["fusion switch differs"][0]


# ---- register_op replaces a definition -----------------------------------------------------------

def times(k):
    def reference(x):
        return x * k
    return reference


def custom_graph(name):
    return SubGraph((OpNode(name, ("x",), ("y",)), OpNode("relu", ("y",), ("out",))),
                    ("x",), ("out",))


@pytest.mark.parametrize("fresh_scheduler", [True, False], ids=["new scheduler", "re-run"])
def test_register_op_again_replaces_the_op_and_its_cached_executors(fresh_scheduler):
    name = "reliability_custom_add_scale"
    x = partial(0, 8, 32)
    config = FusionConfig(min_tensor_size=0)
    scheduler = FusionScheduler(config)
    with infini_dist.config.patch(benchmark_warmup=1, benchmark_reps=2):
        scheduler.register_op(name, times(2.0), implementations={"a": times(2.0)})
        assert torch.equal(scheduler.dispatch(custom_graph(name), {"x": x})["out"],
                           torch.relu(x * 2.0))
        if fresh_scheduler:
            scheduler = FusionScheduler(config)
        # The same name, new definitions: a notebook cell edited and run again.
        scheduler.register_op(name, times(-3.0), implementations={"a": times(-3.0),
                                                                 "b": times(-3.0)})
        out = scheduler.dispatch(custom_graph(name), {"x": x})["out"]
        assert torch.equal(out, torch.relu(x * -3.0))
        # A scheduler made before the replacement drops its routes and executors as well.
        assert torch.equal(FusionScheduler(config).dispatch(custom_graph(name), {"x": x})["out"],
                           out)


def test_close_enough_matches_nan_and_inf_by_position():
    e = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    assert close_enough(e.clone(), e)
    assert not close_enough(torch.tensor([1.0, 0.0, float("inf"), -float("inf"), 2.0]), e)
    assert not close_enough(torch.tensor([float("nan"), 1.0, float("inf"), -float("inf"), 2.0]),
                            e)
    assert not close_enough(torch.tensor([1.0, float("nan"), -float("inf"), -float("inf"), 2.0]),
                            e)
    assert not close_enough(torch.tensor([1.5, float("nan"), float("inf"), -float("inf"), 2.0]),
                            e)
