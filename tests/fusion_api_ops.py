"""The user op and fixtures of the seed-API tests (test_fusion_api.py, test_fusion_fallback.py):
a user op with two implementations, an anchor the engine tunes without a process group.
Import the fixtures by name into a test module to use them there.
"""

import pytest
import torch

import infini_dist
from infini_dist.fusion import FusionScheduler, OpNode, SubGraph
from infini_dist.scheduler import engine
from infini_dist.scheduler.store import STORE

FLAKY = {"error": None}  # set to an exception to make the "flaky" implementation raise


def triple_reference(x):
    return x * 3


def triple_fast(x):
    return x * 3


def triple_flaky(x):
    if FLAKY["error"] is not None:
        raise FLAKY["error"]
    return x * 3


OP = "fusion_api_triple"


@pytest.fixture(autouse=True)
def setup_ops_and_fast_tuning():
    FusionScheduler().register_op(OP, triple_reference,
                                  implementations={"fast": triple_fast, "flaky": triple_flaky})
    FLAKY["error"] = None
    with infini_dist.config.patch(benchmark_reps=2, benchmark_warmup=1):
        yield
    FLAKY["error"] = None


@pytest.fixture
def prefer_fused(monkeypatch):
    """Make every fused or user-implementation choice beat native, so the choice
    that runs after tuning is deterministic (one of the implementations)."""
    monkeypatch.setattr(STORE, "timing_hook",
                        lambda medians: {n: t * (1e3 if n == "native" else 1.0)
                                         for n, t in medians.items()})


@pytest.fixture
def engine_calls(monkeypatch):
    """Records every graph the scheduler hands to the engine."""
    seen = []
    real = engine.executor_for

    def spy(graph, settings):
        seen.append(graph)
        return real(graph, settings)
    monkeypatch.setattr(engine, "executor_for", spy)
    return seen


def triple_relu_graph():
    return SubGraph((OpNode(OP, ("x",), ("tripled",)),
                     OpNode("relu", ("tripled",), ("output",))), ("x",), ("output",))


def sample(rows=16, cols=128, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(dtype) + 0.25


def expected(x):
    return torch.relu(x.double() * 3)


def assert_correct(out, x):
    assert set(out) == {"output"}
    torch.testing.assert_close(out["output"].double(), expected(x), rtol=1e-6, atol=1e-6)

