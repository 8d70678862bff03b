"""Issue 12, item 1's last gap: with agree_every_call, a call whose route or decision is cached on
some ranks and new (or another cached one) on others fails with RankMismatchError on every rank
within the tuning timeout, instead of leaving the cached ranks in their collective. Multi-rank
cases run on 2 and 3 gloo ranks; each rank reports (case, outcome, seconds) for
docs/reliability.md.
"""

from __future__ import annotations

import pytest
import torch

import infini_dist
from infini_dist import config
from infini_dist.fusion import FusionConfig, FusionScheduler
from infini_dist.scheduler.every_call import wanted
from infini_dist.scheduler.op_registry import close_enough

from multirank import run_ranks
from test_reliability_inputs import outcome as short_outcome, partial, relu_scale_graph

TIMEOUT_S = 6  # tuning_timeout_s: every mismatch must come well before it
CACHED, NEW = (64, 32), (32, 32)  # both over FusionConfig's min_tensor_size: both route fused


def outcome(fn):
    return short_outcome(fn, chars=600)  # the whole message: it must name the shapes


def _settings(mode):
    return config.patch(tuning_timeout_s=TIMEOUT_S, benchmark_warmup=1, benchmark_reps=2,
                        max_fusion_depth=1, agree_every_call=mode)


def _relu_scale(rank, world, shape, seed, call):
    """Run `call(x)` on this rank's partial; check it against the float64 reference."""
    out = call(partial(rank, *shape, seed=seed))
    want = torch.relu(sum(partial(r, *shape, seed=seed).double() for r in range(world))) * 2.0
    assert close_enough(out, want.float()), "wrong result"
    return out


def divergence_rank(rank, world, mode, api):
    from infini_dist.ops import all_reduce_relu_scale
    scheduler = FusionScheduler()
    if api == "dispatch":
        graph = relu_scale_graph()
        call = lambda x: scheduler.dispatch(graph, {"x": x})["out"]  # noqa: E731
    else:
        call = lambda x: all_reduce_relu_scale(x, 2.0)  # noqa: E731
    report, outputs = {}, {}
    with _settings(mode):
        report["first call, same shape"] = outcome(
            lambda: outputs.setdefault("first", _relu_scale(rank, world, CACHED, 1, call)))
        # Rank 0 repeats its cached shape, the others meet a new one.
        report["hit/miss"] = outcome(
            lambda: _relu_scale(rank, world, CACHED if rank == 0 else NEW, 2, call))
        report["new shape on every rank"] = outcome(
            lambda: _relu_scale(rank, world, NEW, 3, call))
        # Both shapes cached everywhere; rank 0 takes one, the others the other.
        report["hit/hit, different"] = outcome(
            lambda: _relu_scale(rank, world, CACHED if rank == 0 else NEW, 4, call))
        report["same shape after the mismatches"] = outcome(
            lambda: outputs.setdefault("last", _relu_scale(rank, world, CACHED, 5, call)))
    return report, outputs


@pytest.mark.parametrize("api", ["dispatch", "eager op"])
@pytest.mark.parametrize("mode", ["auto", True], ids=["auto on CPU", "True"])
@pytest.mark.parametrize("world", [2, 3])
def test_cached_and_new_signatures_across_ranks_fail_everywhere_in_time(world, mode, api):
    results = run_ranks(divergence_rank, world, mode, api, timeout=240)
    for report, _ in results:
        for case in ("first call, same shape", "new shape on every rank",
                     "same shape after the mismatches"):
            assert report[case][0] == "ok", (case, report)
        for case in ("hit/miss", "hit/hit, different"):
            text, seconds = report[case]
            assert text.startswith("RankMismatchError"), (case, report)
            assert "input shapes or dtypes" in text and "(64, 32)" in text and "(32, 32)" in text
            assert seconds < TIMEOUT_S, (case, report)  # no rank waited for a timeout
    for name in ("first", "last"):  # fused outputs bitwise identical across ranks
        assert all(torch.equal(outputs[name], results[0][1][name]) for _, outputs in results)


def unagreed_rank(rank, world, api):
    """agree_every_call=False: rank 0's call is cached, rank 1's is new. Rank 1 times out; rank 0
    sits in its collective until rank 1 gives up and tears its process group down."""
    from infini_dist.ops import all_reduce_relu_scale
    scheduler = FusionScheduler()
    graph = relu_scale_graph()
    call = ((lambda x: scheduler.dispatch(graph, {"x": x})["out"]) if api == "dispatch"
            else (lambda x: all_reduce_relu_scale(x, 2.0)))
    with _settings(False):
        _relu_scale(rank, world, CACHED, 1, call)
        return outcome(lambda: call(partial(rank, *(CACHED if rank == 0 else NEW))))


@pytest.mark.parametrize("api", ["dispatch", "eager op"])
def test_with_the_flag_off_the_rank_that_times_out_names_the_flag(api):
    reports = run_ranks(unagreed_rank, 2, api, timeout=120)
    text, seconds = reports[1]
    assert text.startswith("ControlPlaneError"), text
    assert "agree_every_call" in text and "cached" in text, text
    assert TIMEOUT_S - 1 < seconds < TIMEOUT_S + 5, seconds
    assert reports[0][0] != "ok"  # the cached rank's collective broke off, it did not hang


def test_auto_resolves_per_device_and_debug_level(monkeypatch):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert wanted("auto", cpu) and not wanted("auto", cuda)
    assert wanted(True, cuda) and not wanted(False, cpu)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    assert not wanted("auto", cuda)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert wanted("auto", cuda) and not wanted(False, cuda)


def test_the_flag_is_validated_and_reaches_the_schedulers_settings():
    assert config.agree_every_call == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="agree_every_call"):
            config.agree_every_call = bad
    assert config.agree_every_call == "auto"
    assert config.parse_env("agree_every_call", " AUTO ") == "auto"
    assert config.parse_env("agree_every_call", "on") is True
    assert config.parse_env("agree_every_call", "0") is False
    with pytest.raises(ValueError, match="INFINI_DIST_AGREE_EVERY_CALL"):
        config.parse_env("agree_every_call", "sometimes")
    with pytest.raises(ValueError, match="agree_every_call"):
        FusionConfig(agree_every_call="always")
    assert FusionScheduler()._settings().agree_every_call == "auto"
    with config.patch(agree_every_call=True):
        assert FusionScheduler()._settings().agree_every_call is True
        assert infini_dist.config.snapshot().agree_every_call is True
        assert FusionScheduler(FusionConfig(agree_every_call=False))._settings() \
            .agree_every_call is False
