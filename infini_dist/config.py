"""Flags that govern fusion and tuning.

Read and set them as module attributes (`infini_dist.config.max_fusion_depth = 2`); every value
is validated when set. `INFINI_DIST_<NAME>` in the environment sets the starting value, and
`config.patch(**flags)` changes flags for the length of a `with` block.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import types

from infini_dist.scheduler.settings import AUTO, Settings

# overlap: independent work right before a collective (a backward graph's weight-gradient
# GEMMs) joins its site, so that a choice may run it while the collective is in flight.
FUSION_TYPES = ("epilogue", "prologue", "cross_subgraph", "overlap")
DEFAULT_FUSION_TYPES = ("epilogue", "prologue", "cross_subgraph")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


# The value validators, shared with FusionConfig (fusion/router.py): a wrong type raises
# TypeError, a value out of range ValueError, as torch does.
def _int_at_least(minimum, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_positive_int(name, value):
    return _int_at_least(1, name, value)


def check_nonneg_int(name, value):
    return _int_at_least(0, name, value)


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _positive_float(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def _threshold(name, value):
    value = _positive_float(name, value)
    if value < 1.0:
        raise ValueError(f"{name} is a speed-up ratio and must be >= 1.0, got {value!r}")
    return value


def _fusion_types(name, value):
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    unknown = [v for v in value if v not in FUSION_TYPES]
    if unknown:
        raise ValueError(f"{name}: unknown fusion types {unknown}; choose from {FUSION_TYPES}")
    return tuple(t for t in FUSION_TYPES if t in value)  # canonical order, no duplicates


def check_bool_or_auto(name, value):
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ValueError(f"{name} must be True, False or {AUTO!r}, got {value!r}")


def _path(name, value):
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{name} must be a path, got {value!r}")
    return str(value)


def _token_buckets(name, value):
    # Upper bounds of the token buckets, strictly increasing; empty means powers of two.
    if isinstance(value, (str, int)):
        value = (value,)
    try:
        bounds = tuple(check_positive_int(name, int(v) if isinstance(v, str) else v)
                       for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be increasing ints >= 1, got {value!r}") from None
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {bounds}")
    return bounds


# name -> (default, validator)
FLAGS = {
    "enable_custom_op_fusion": (True, check_bool),
    "custom_op_fusion_types": (DEFAULT_FUSION_TYPES, _fusion_types),
    "enable_recursive_fusion": (True, check_bool),
    "max_fusion_depth": (5, check_nonneg_int),  # GPT-NeoX: 2 bias adds, 2 adds, LayerNorm
    # The compile pass also takes the matmul (mm, addmm, linear) that produces an all_reduce's
    # input into the site, as its prologue (GEMM + all_reduce overlap). "auto": only in graphs
    # that Inductor captures in CUDA graphs (mode="reduce-overhead" or "max-autotune") on CUDA
    # tensors, none on the CPU (compile/capture.py). There it wins prefill and holds decode on
    # 2 GPUs; in a graph run launch by launch a site with its GEMM costs more host time (two
    # launches, not made from C++), which made a training step 2-16% slower
    # (docs/benchmarks_history.md, session 34).
    "matmul_prologue": (AUTO, check_bool_or_auto),
    # With matmul_prologue: consecutive prefill sites whose residual runs from one to the next
    # become one row-split chain (compile/chain_match.py), which runs site by site or with each
    # all-reduce split under the GEMMs beside it, as timing the two in lockstep decides.
    "row_split": (True, check_bool),
    # The compile pass makes sites in backward graphs too. False leaves a backward graph's
    # collectives to Inductor: its compute/communication overlap (reorder_for_compute_comm_
    # overlap) can then issue each all_reduce early and wait for it after the weight-gradient
    # GEMMs, which our synchronous sites cannot. Which is faster is measured by bench --train.
    "backward_sites": (True, check_bool),
    "fusion_speedup_threshold": (1.0, _threshold),
    "max_autotune_threads": (4, check_positive_int),
    "benchmark_warmup": (3, check_nonneg_int),
    "benchmark_reps": (10, check_positive_int),
    "benchmark_cuda_graphs": (True, check_bool),
    "tuning_timeout_s": (300.0, _positive_float),
    "cache_dir": ("~/.cache/infini_dist", _path),
    "enable_disk_cache": (True, check_bool),
    "debug_mode": (False, check_bool),
    "token_buckets": ((), _token_buckets),
    "max_token_bucket": (8192, check_positive_int),
    "tune_at_request_time": (True, check_bool),
    "agree_every_call": (AUTO, check_bool_or_auto),
    # Kernel launch knobs for experiments (the engine passes them to kernels/ explicitly). They
    # shape launches, so they must be the same on every rank. symm_timeout_s: a symmetric-memory
    # kernel waiting longer for a peer traps instead of hanging. symm_group_items /
    # symm_round_items: n > 0 forces the two-shot items per step / per round (0: by size).
    # symm_preload: the Lamport kernels read the epilogue's operands before they poll (A/B).
    # symm_pdl: programmatic dependent launch where a kernel and the GPU take it (A/B).
    # fast_launch: False keeps every kernel launch on Triton's normal path (A/B timing).
    "symm_timeout_s": (300.0, _positive_float),
    "symm_group_items": (0, check_nonneg_int),
    "symm_round_items": (0, check_nonneg_int),
    "symm_preload": (True, check_bool),
    "symm_pdl": (True, check_bool),
    "fast_launch": (True, check_bool),
    # express_ops: an eager op's call whose committed symmetric-memory launch was recorded is
    # matched and launched from C++ (kernels/express.py); False keeps them all in Python.
    "express_ops": (True, check_bool),
}


def parse_env(name: str, text: str):
    """Turn INFINI_DIST_<NAME>'s text into a valid value for the flag, or raise."""
    default, validate = FLAGS[name]
    text = text.strip()
    if isinstance(default, bool) or default == AUTO:
        lowered = text.lower()
        if lowered in _TRUE_WORDS:
            return True
        if lowered in _FALSE_WORDS:
            return False
        if default == AUTO and lowered == AUTO:
            return AUTO
        raise ValueError(f"INFINI_DIST_{name.upper()}={text!r} is not a boolean"
                         + (f" or {AUTO!r}" if default == AUTO else ""))
    try:
        if isinstance(default, int):
            return validate(name, int(text))
        if isinstance(default, float):
            return validate(name, float(text))
    except ValueError as error:
        raise ValueError(f"INFINI_DIST_{name.upper()}={text!r}: {error}") from None
    if isinstance(default, tuple):
        return validate(name, tuple(p.strip() for p in text.split(",") if p.strip()))
    return validate(name, text)


class _ConfigModule(types.ModuleType):
    def _changed(self) -> None:
        super().__setattr__("_snapshot", None)
        # The engine's C++ records were made under the old flags.
        from infini_dist.scheduler.store import STORE
        STORE.forget_launches()

    def __setattr__(self, name, value):
        if name in FLAGS:
            value = FLAGS[name][1](name, value)
            self._changed()
        elif not name.startswith("_") and name not in self.__dict__:
            raise AttributeError(f"infini_dist.config has no flag {name!r}; flags: "
                                 f"{', '.join(FLAGS)}")
        super().__setattr__(name, value)

    @contextlib.contextmanager
    def patch(self, **flags):
        unknown = [k for k in flags if k not in FLAGS]
        if unknown:
            raise AttributeError(f"infini_dist.config has no flag(s) {unknown}")
        saved = {k: getattr(self, k) for k in flags}
        try:
            for key, value in flags.items():
                setattr(self, key, value)
            yield self
        finally:
            for key, value in saved.items():
                super().__setattr__(key, value)
            self._changed()

    def snapshot(self) -> Settings:
        # Cached until a flag changes: every eager fused op asks for it on every call.
        cached = self.__dict__.get("_snapshot")
        if cached is None:
            cached = Settings(**{k: getattr(self, k) for k in FLAGS})
            super().__setattr__("_snapshot", cached)
        return cached

    def reset(self) -> None:
        """Back to defaults, then environment overrides."""
        for key, (default, validate) in FLAGS.items():
            env = os.environ.get(f"INFINI_DIST_{key.upper()}")
            value = parse_env(key, env) if env is not None else validate(key, default)
            super().__setattr__(key, value)
        self._changed()


sys.modules[__name__].__class__ = _ConfigModule
sys.modules[__name__].reset()
