"""launch/bench_backward_split.py's sites (the input gradients of Llama-3-8B's column-parallel
linears at TP = world) and its ways; the split and the timing need GPUs, the floor's two GEMMs
are checked here against float64."""

from __future__ import annotations

import pytest
import torch

from infini_dist.launch.bench_backward_split import backward_site, ways, widths
from infini_dist.scheduler.ir import subgraph_from_text
from infini_dist.scheduler.split_chain import ChainRunner, chain_text

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world", [2, 4])
def test_sites_are_the_input_gradients_of_llama_3_8b(world):
    assert widths(world) == {"qkv": 6144 // world, "gate_up": 28672 // world}
    site = backward_site("g0", 2048, widths(world)["qkv"])
    assert (site.k, site.hidden, site.transpose, site.readers) == (6144 // world, 4096, False, ())
    matmul, *rest = subgraph_from_text(site.site).nodes
    assert matmul.attr("transpose_weight") is False  # dX = G @ W, W [N, hidden]
    assert [n.op_type for n in rest] == ["all_reduce", "add_rms_norm"]


def test_the_floor_computes_both_gradients():
    runner = ChainRunner(chain_text("g0", torch.float32, [backward_site("g0", 16, 24)]), None)
    choices, (g, w, x, dw) = ways(runner, None, torch.device("cpu"))
    assert [c.name for c in choices] == ["floor", "nccl", "sites", "split"]
    assert g.abs().min() > 0 and w.abs().sum() > 0 and x.abs().sum() > 0  # never zeros
    dx = choices[0].run(None)
    torch.testing.assert_close(dx.double(), g.double() @ w.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), g.double().t() @ x.double(), rtol=1e-5, atol=1e-4)
