"""Dynamic-shape graphs share the token buckets: a DTensor TP block compiled with dynamic=True, or
with dynamic=False and torch._dynamo.mark_dynamic on the token dim (so that the mark alone makes
the graph dynamic: unmarked, each count would compile anew), on 2 gloo ranks, run at 24 token
counts, is compiled once, tunes each site once per bucket and matches eager at every count; the
fused_site fake (which the pass calls on the traced values) keeps symbolic shapes.

The infini_dist backend (the pass without Inductor's C++ compile, which takes minutes on a
shared CPU runner) traces the same post-grad forms; test_compile_tp covers Inductor itself."""

from __future__ import annotations

import pytest
import torch

from multirank import run_ranks
from test_compile_tp import _env, _max_diff

COUNTS = list(range(2, 26))  # 24 counts (1 would be specialised by Dynamo): buckets 2..32


def dynamic_rank(rank, world, how):
    from torch.distributed.device_mesh import init_device_mesh

    import infini_dist.compile as idc
    import tp_block
    from infini_dist.scheduler.cache import DECISIONS
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = tp_block.shard(tp_block.Block(), mesh)
    marked = how == "mark_dynamic"
    compiled = idc.compile_model(block, backend="infini_dist", dynamic=not marked)
    diffs, outs = [], []
    with torch.no_grad():
        for tokens in COUNTS:
            x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(tokens))
            if marked:
                torch._dynamo.mark_dynamic(x, 1)
            out = compiled(x)
            diffs.append(_max_diff(out, block(x)))
            outs.append(out)
    return {"diffs": diffs, "tunings": DECISIONS.misses, "sites": idc.stats["sites"],
            "outs": outs,
            "buckets": sorted({d["bucket"] for d in idc.decisions()})}


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_compile_tunes_once_per_bucket(how):
    results = run_ranks(dynamic_rank, 2, how, env=_env(), timeout=300)
    for r in results:
        # one graph for all 24 counts (unique_graphs also counts native's own compiles)
        assert r["sites"] == 2
        assert max(r["diffs"]) < 1e-5
        assert r["tunings"] <= 2 * 5  # 2 sites x buckets 2, 4, 8, 16, 32 (not 2 x 24)
        assert r["buckets"] == [32]  # the last decision of each site: the bucket of 25
    assert results[0]["tunings"] == results[1]["tunings"]
    for a, b in zip(results[0]["outs"], results[1]["outs"]):
        assert torch.equal(a, b)


def test_fused_site_fake_keeps_symbolic_token_counts():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    import infini_dist.compile  # noqa: F401  (registers the op)
    from infini_dist.ops import add_rms_norm_graph
    mode = FakeTensorMode(shape_env=ShapeEnv())
    rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(5, 16), symbolic_context=rows)
    weight = mode.from_tensor(torch.randn(16))
    with mode:
        residual = torch.empty_like(x)
        out, new_residual = torch.ops.infini_dist.fused_site(
            [x, residual, weight], add_rms_norm_graph(1e-6).canonical())
    assert isinstance(out.shape[0], torch.SymInt) and out.shape[0] is not None
    assert str(out.shape[0]) == str(x.shape[0]) and out.shape[1] == 16
    assert new_residual.shape == x.shape and out.dtype == x.dtype
