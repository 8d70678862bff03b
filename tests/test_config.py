import os
import subprocess
import sys

import pytest

import infini_dist
from infini_dist import config
from infini_dist.config import parse_env


def test_defaults_and_validation():
    assert config.max_fusion_depth == 5
    assert config.custom_op_fusion_types == ("epilogue", "prologue", "cross_subgraph")
    for name, bad in [("max_fusion_depth", -1), ("max_autotune_threads", 0),
                      ("fusion_speedup_threshold", 0.9), ("custom_op_fusion_types", ("sideways",)),
                      ("benchmark_reps", 0), ("tuning_timeout_s", 0), ("cache_dir", "")]:
        with pytest.raises(ValueError, match=name):
            setattr(config, name, bad)
    for name, bad in [("max_fusion_depth", 1.5), ("enable_recursive_fusion", "yes"),
                      ("benchmark_warmup", True)]:
        with pytest.raises(TypeError, match=name):  # a wrong type, as torch reports it
            setattr(config, name, bad)
    with pytest.raises(AttributeError, match="no flag"):
        config.max_fusion_dept = 2  # a typo must not pass silently


def test_patch_restores_even_on_error():
    before = config.snapshot()
    with pytest.raises(RuntimeError):
        with config.patch(max_fusion_depth=1, custom_op_fusion_types="epilogue"):
            assert config.max_fusion_depth == 1
            assert config.custom_op_fusion_types == ("epilogue",)
            raise RuntimeError("boom")
    assert config.snapshot() == before
    with pytest.raises(ValueError):
        with config.patch(max_fusion_depth=-2):
            pass
    assert config.snapshot() == before


def test_env_parsing():
    assert parse_env("debug_mode", "on") is True and parse_env("debug_mode", "0") is False
    assert parse_env("max_fusion_depth", "5") == 5
    assert parse_env("fusion_speedup_threshold", "1.25") == 1.25
    assert parse_env("custom_op_fusion_types", "prologue, epilogue") == ("epilogue", "prologue")
    for name, text in [("debug_mode", "maybe"), ("max_fusion_depth", "three"),
                       ("max_fusion_depth", "-1"), ("custom_op_fusion_types", "nope")]:
        with pytest.raises(ValueError, match=f"INFINI_DIST_{name.upper()}|{name}"):
            parse_env(name, text)


def test_env_overrides_at_import():
    env = dict(os.environ, INFINI_DIST_MAX_FUSION_DEPTH="1", INFINI_DIST_DEBUG_MODE="true",
               INFINI_DIST_CUSTOM_OP_FUSION_TYPES="epilogue")
    code = ("import infini_dist as d; c = d.config; "
            "print(c.max_fusion_depth, c.debug_mode, c.custom_op_fusion_types)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split(None, 2)
    assert out[:2] == ["1", "True"] and "epilogue" in out[2] and "prologue" not in out[2]
    bad = dict(os.environ, INFINI_DIST_MAX_FUSION_DEPTH="lots")
    result = subprocess.run([sys.executable, "-c", "import infini_dist"], env=bad,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "INFINI_DIST_MAX_FUSION_DEPTH" in result.stderr


def test_snapshot_is_immutable_and_keyed_by_decision_flags():
    snap = infini_dist.config.snapshot()
    with pytest.raises(Exception):
        snap.max_fusion_depth = 9
    with config.patch(max_fusion_depth=1):
        assert config.snapshot().decision_fields() != snap.decision_fields()
    with config.patch(benchmark_cuda_graphs=False):  # timing mode changes what wins
        assert config.snapshot().decision_fields() != snap.decision_fields()
    with config.patch(benchmark_reps=50):  # timing effort does not change what is decided
        assert config.snapshot().decision_fields() == snap.decision_fields()


def test_kernel_launch_knobs_are_validated_flags():
    from infini_dist.kernels.symm_device import SymmTuning
    assert (config.symm_timeout_s, config.symm_group_items, config.symm_round_items,
            config.fast_launch) == (300.0, 0, 0, True)
    assert parse_env("fast_launch", "0") is False and parse_env("symm_group_items", "4") == 4
    for name, bad in [("symm_timeout_s", 0), ("symm_group_items", -1), ("symm_round_items", -2)]:
        with pytest.raises(ValueError, match=name):
            setattr(config, name, bad)
    with pytest.raises(TypeError, match="symm_group_items"):
        config.symm_group_items = 2.5
    for name, text in [("fast_launch", "2"), ("symm_round_items", "many"),
                       ("symm_timeout_s", "-1")]:
        with pytest.raises(ValueError, match=f"INFINI_DIST_{name.upper()}"):
            parse_env(name, text)
    # The kernels' own check, for callers that build the knobs themselves.
    for bad in ({"timeout_s": 0}, {"group_items": -1}, {"round_items": 1.5}, {"preload": 1},
                {"pdl": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SymmTuning(**bad)
