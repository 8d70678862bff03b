"""Training forward graphs keep the norm's rsqrt for backward: a site exposes it as an rms_rstd
op beside add_rms_norm, and gives the norm up whole when the rsqrt cannot be exposed."""

from __future__ import annotations

import pytest
import torch

from infini_dist.scheduler import op_registry
from fx_graphs import FUSED, ar, export, fuse, ops_of, rand


def _norm_keeping_rsqrt(h, w, eps):
    h32 = h.float()
    rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return w * (h32 * rstd).to(h.dtype), rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", [1, 3])
def test_saved_rsqrt_becomes_rms_rstd_beside_add_rms_norm(dtype, depth):
    def f(x, residual, w):
        h = ar(x) + residual
        out, rstd = _norm_keeping_rsqrt(h, w, 1e-5)
        return out, h, rstd
    gm = export(f, rand(2, 4, 16, dtype=dtype), rand(2, 4, 16, dtype=dtype, seed=1),
                rand(16, dtype=dtype, seed=2))
    (sub,) = fuse(gm, max_fusion_depth=depth)  # the exposed value does not count as depth
    assert ops_of(sub) == ["all_reduce", "add_rms_norm", "rms_rstd"]
    _, norm, rstd = sub.nodes
    assert rstd.inputs == (norm.outputs[1],) and rstd.attr("eps") == pytest.approx(1e-5, rel=1e-6)
    assert set(sub.output_names) == {*norm.outputs, *rstd.outputs}
    fused = [n for n in gm.graph.nodes if n.target is FUSED]
    assert len(fused) == 1 and not any(n.target is torch.ops.aten.rsqrt.default
                                       for n in gm.graph.nodes)


def test_rms_rstd_reference_is_the_fp32_rsqrt():
    x = rand(3, 8, dtype=torch.bfloat16)
    (got,) = op_registry.run_node("rms_rstd", [x], {"eps": 1e-5})
    want = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert got.dtype == torch.float32 and got.shape == (3, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_rsqrt_read_before_the_norm_ends_drops_the_norm_whole():
    def f(x, residual, w):
        h = ar(x) + residual
        h32 = h.float()
        rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)
        early = rstd * 2.0  # read before the norm's last node: the site cannot end after it
        return w * (h32 * rstd).to(h.dtype) + early, h
    gm = export(f, rand(2, 4, 16), rand(2, 4, 16, seed=1), rand(16, seed=2))
    (sub,) = fuse(gm)
    # add_rms_norm goes as one op (the folded add with it), and its exposed rsqrt with it.
    assert ops_of(sub) == ["all_reduce"]
    gm.graph.lint()
    assert sum(n.target is torch.ops.aten.rsqrt.default for n in gm.graph.nodes) == 1
