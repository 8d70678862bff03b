"""The seed scheduler API (infini_dist.fusion): config validation, routing heuristics and
caching, fused around a user op with several implementations (tests/fusion_api_ops.py).
Fallback on error and debug logs: test_fusion_fallback.py.
"""

import logging

import pytest
import torch

import infini_dist
from infini_dist.fusion import FusionConfig, FusionScheduler, OpNode, SubGraph
from infini_dist.scheduler.cache import DECISIONS

from fusion_api_ops import (OP, assert_correct, engine_calls, expected,  # noqa: F401 - fixtures
                            prefer_fused, sample, setup_ops_and_fast_tuning, triple_fast,
                            triple_flaky, triple_reference, triple_relu_graph)

# ---- config ---------------------------------------------------------------------------------------

def test_config_defaults():
    config = FusionConfig()
    assert (config.enable_fusion, config.enable_cache, config.min_nodes, config.min_tensor_size,
            config.op_whitelist, config.fallback_on_error, config.debug_mode) == \
        (True, True, 2, 1024, None, True, False)
    assert FusionScheduler().config == config


@pytest.mark.parametrize("field, value, error, match", [
    ("enable_fusion", "yes", TypeError, "enable_fusion must be a bool"),
    ("enable_cache", 1, TypeError, "enable_cache must be a bool"),
    ("fallback_on_error", None, TypeError, "fallback_on_error must be a bool"),
    ("debug_mode", "false", TypeError, "debug_mode must be a bool"),
    ("min_nodes", 0, ValueError, "min_nodes must be an int >= 1"),
    ("min_nodes", 2.0, TypeError, "min_nodes must be an int"),
    ("min_nodes", True, TypeError, "min_nodes must be an int"),
    ("min_tensor_size", -1, ValueError, "min_tensor_size must be an int >= 0"),
    ("min_tensor_size", "1024", TypeError, "min_tensor_size must be an int"),
    ("op_whitelist", "relu", TypeError, "bare string"),
    ("op_whitelist", ("relu", 3), TypeError, "non-empty op names"),
    ("op_whitelist", ("relu", "no_such_op"), ValueError, r"unknown ops \['no_such_op'\]"),
    ("op_whitelist", 5, TypeError, "collection of op names"),
])
def test_config_rejects_bad_values(field, value, error, match):
    with pytest.raises(error, match=match):
        FusionConfig(**{field: value})
    config = FusionConfig()
    with pytest.raises(error, match=match):  # assignment is checked too
        setattr(config, field, value)
    assert getattr(config, field) == getattr(FusionConfig(), field)


def test_config_normalises_and_rejects_unknown_fields():
    config = FusionConfig(op_whitelist=["relu", "all_reduce", "relu"], min_tensor_size=0)
    assert config.op_whitelist == ("all_reduce", "relu")
    with pytest.raises(AttributeError, match="no field 'enable_fuson'"):
        config.enable_fuson = False
    with pytest.raises(TypeError):
        FusionConfig(enable_fuson=False)
    with pytest.raises(TypeError, match="must be a FusionConfig"):
        FusionScheduler({"enable_fusion": False})


def test_wrong_subgraphs_are_rejected_at_construction():
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        SubGraph((OpNode("no_such_op", ("x",), ("y",)),), ("x",), ("y",))
    with pytest.raises(ValueError, match="reads 'ghost'"):
        SubGraph((OpNode("add", ("x", "ghost"), ("y",)),), ("x",), ("y",))
    with pytest.raises(TypeError, match="bare string"):
        OpNode("relu", "x_in", ("y",))
    with pytest.raises(TypeError, match="bare string"):
        SubGraph((OpNode("relu", ("x",), ("y",)),), "x", ("y",))


def test_dispatch_rejects_bad_inputs():
    scheduler = FusionScheduler()
    graph, x = triple_relu_graph(), sample()
    with pytest.raises(ValueError, match=r"missing \['x'\]"):
        scheduler.dispatch(graph, {})
    with pytest.raises(ValueError, match=r"unexpected \['y'\]"):
        scheduler.dispatch(graph, {"x": x, "y": x})
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        scheduler.dispatch(graph, {"x": x.tolist()})
    with pytest.raises(TypeError, match="must be a SubGraph"):
        scheduler.dispatch([graph], {"x": x})
    assert scheduler.get_cache_stats()["misses"] == 0


# ---- heuristics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config, rows, path, reason", [
    (dict(), 16, "fused", "passes every heuristic"),
    (dict(enable_fusion=False), 16, "unfused", "enable_fusion=False"),
    (dict(op_whitelist=(OP,)), 16, "unfused", "['relu'] are not in op_whitelist"),
    (dict(op_whitelist=(OP, "relu")), 16, "fused", "passes every heuristic"),
    (dict(min_nodes=3), 16, "unfused", "2 node(s) < min_nodes=3"),
    (dict(), 4, "unfused", "512 elements < min_tensor_size=1024"),  # 4 x 128
    (dict(min_tensor_size=512), 4, "fused", "passes every heuristic"),
])
def test_each_heuristic_routes_to_its_path(config, rows, path, reason, engine_calls, caplog):
    scheduler = FusionScheduler(FusionConfig(debug_mode=True, **config))
    graph, x = triple_relu_graph(), sample(rows)
    assert scheduler.route(graph, {"x": x}).path == path
    with caplog.at_level(logging.DEBUG, logger="infini_dist"):
        out = scheduler.dispatch(graph, {"x": x})
    assert_correct(out, x)
    routed = [r.getMessage() for r in caplog.records if "routed graph" in r.getMessage()]
    assert len(routed) == 1 and f": {path} (" in routed[0] and reason in routed[0]
    stats = scheduler.get_cache_stats()
    # The engine really ran it (and tuned its one site) exactly when the route says fused.
    if path == "fused":
        assert engine_calls == [graph] and DECISIONS.misses == 1
        assert (stats["fused_dispatches"], stats["unfused_dispatches"]) == (1, 0)
    else:
        assert engine_calls == [] and DECISIONS.misses == 0 and len(DECISIONS) == 0
        assert (stats["fused_dispatches"], stats["unfused_dispatches"]) == (0, 1)


def test_graph_without_anchor_or_with_global_flag_off_runs_unfused(engine_calls):
    scheduler = FusionScheduler()
    plain = SubGraph((OpNode("scale", ("x",), ("s",), {"scale": 3.0}),
                      OpNode("relu", ("s",), ("output",))), ("x",), ("output",))
    x = sample()
    assert "nothing to fuse" in scheduler.route(plain, {"x": x}).reason
    assert_correct(scheduler.dispatch(plain, {"x": x}), x)
    with infini_dist.config.patch(enable_custom_op_fusion=False):
        route = scheduler.route(triple_relu_graph(), {"x": x})
        assert route.path == "unfused" and "enable_custom_op_fusion=False" in route.reason
        assert_correct(scheduler.dispatch(triple_relu_graph(), {"x": x}), x)
    assert engine_calls == [] and DECISIONS.misses == 0
    assert scheduler.get_cache_stats()["unfused_dispatches"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fusion_disabled_gives_the_same_result(dtype, prefer_fused, engine_calls):
    graph, x = triple_relu_graph(), sample(dtype=dtype)
    fused = FusionScheduler().dispatch(graph, {"x": x})
    plain = FusionScheduler(FusionConfig(enable_fusion=False)).dispatch(graph, {"x": x})
    assert engine_calls == [graph]  # only the first scheduler went through the engine
    assert fused["output"].dtype == dtype
    assert torch.equal(fused["output"], plain["output"])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused["output"].double(), expected(x), rtol=tol, atol=tol)


# ---- caching --------------------------------------------------------------------------------------

def test_cache_stats_after_repeated_dispatch_and_clear(engine_calls):
    scheduler = FusionScheduler()
    graph = triple_relu_graph()
    x, wide = sample(), sample(16, 256, seed=1)
    for _ in range(3):
        assert_correct(scheduler.dispatch(graph, {"x": x}), x)
    stats = scheduler.get_cache_stats()
    assert (stats["size"], stats["hits"], stats["misses"]) == (1, 2, 1)
    assert DECISIONS.misses == 1  # the engine tuned once, then ran its committed choice
    assert_correct(scheduler.dispatch(graph, {"x": wide}), wide)  # new signature: a miss
    stats = scheduler.get_cache_stats()
    assert (stats["size"], stats["hits"], stats["misses"]) == (2, 2, 2)
    assert stats["fused_dispatches"] == 4

    scheduler.clear_cache()
    assert scheduler.get_cache_stats() == dict(size=0, hits=0, misses=0, fused_dispatches=0,
                                               unfused_dispatches=0, fallbacks=0)
    assert_correct(scheduler.dispatch(graph, {"x": x}), x)
    stats = scheduler.get_cache_stats()
    assert (stats["size"], stats["hits"], stats["misses"]) == (1, 0, 1)
    assert DECISIONS.misses == 2  # tuned decisions outlive clear_cache: no third tuning


def test_config_change_is_a_new_decision():
    scheduler = FusionScheduler()
    graph, x = triple_relu_graph(), sample()
    scheduler.dispatch(graph, {"x": x})
    scheduler.config.enable_fusion = False
    assert_correct(scheduler.dispatch(graph, {"x": x}), x)
    stats = scheduler.get_cache_stats()
    assert (stats["misses"], stats["fused_dispatches"], stats["unfused_dispatches"]) == (2, 1, 1)


def test_enable_cache_false_decides_every_time(engine_calls):
    scheduler = FusionScheduler(FusionConfig(enable_cache=False))
    graph, x = triple_relu_graph(), sample()
    for _ in range(3):
        assert_correct(scheduler.dispatch(graph, {"x": x}), x)
    stats = scheduler.get_cache_stats()
    assert (stats["size"], stats["hits"], stats["misses"]) == (0, 0, 3)
    assert len(engine_calls) == 3 and DECISIONS.misses == 1
    # Nor does the engine persist its decision on disk.
    assert not list(__import__("pathlib").Path(infini_dist.config.cache_dir).glob("*.json"))


def test_register_op_goes_to_the_global_registry():
    from infini_dist.scheduler.op_registry import get_op
    scheduler = FusionScheduler()
    spec = get_op(OP)
    assert spec.kind == "custom" and set(spec.implementations) == {"fast", "flaky"}
    scheduler.dispatch(triple_relu_graph(), {"x": sample()})
    assert scheduler.get_cache_stats()["size"] == 1
    scheduler.register_op(OP, triple_reference,
                          implementations={"fast": triple_fast, "flaky": triple_flaky})
    assert scheduler.get_cache_stats()["size"] == 0  # the registry changed: routes recomputed
    with pytest.raises(ValueError, match="built-in"):
        scheduler.register_op("relu", triple_fast)
