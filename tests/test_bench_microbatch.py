"""launch/bench_microbatch.py on CPU: the pipelined order keeps every micro-batch's own order
and puts the other micro-batch's work between a stage's copy and its reduction, and the
GEMM-into-buffer forms of the TP decoder's attention and MLP compute what tp_decoder's do."""

from __future__ import annotations

import pytest
import torch

from infini_dist.launch import bench_microbatch
from infini_dist.launch.tp_decoder import Layer, ModelConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("stages,microbatches", [(1, 2), (8, 2), (5, 3)])
def test_schedule(stages, microbatches):
    order = bench_microbatch.schedule(stages, microbatches)
    every = [(step, mb, k) for mb in range(microbatches) for k in range(stages)
             for step in ("compute", "site")]
    assert sorted(order) == sorted(every)  # each step once
    at = {step: i for i, step in enumerate(order)}
    for mb in range(microbatches):
        for k in range(stages):
            compute, site = at["compute", mb, k], at["site", mb, k]
            assert compute < site
            if k + 1 < stages:  # the next stage reads this one's reduction
                assert site < at["compute", mb, k + 1]
            # what hides this stage's copy: another micro-batch's compute before the reduction
            # (not for the last micro-batch's last stage, the pipeline's tail)
            between = order[compute + 1:site]
            hidden = any(step == "compute" and other != mb for step, other, _ in between)
            assert hidden != (mb == microbatches - 1 and k == stages - 1)


def test_the_gemms_into_a_buffer_compute_the_layers_outputs():
    cfg = ModelConfig(layers=1, hidden=64, mlp=96, heads=4, kv_heads=2, context=8)
    layer = Layer(cfg, 1, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                  "cpu", torch.float64)
    h = torch.randn(2, 5, cfg.hidden, dtype=torch.float64)
    attention, mlp = (torch.empty(10, cfg.hidden, dtype=torch.float64) for _ in range(2))
    bench_microbatch.attention_into(layer, h, attention)
    bench_microbatch.mlp_into(layer, h, mlp)
    torch.testing.assert_close(attention.view(h.shape), layer.attention(h, None, None))
    torch.testing.assert_close(mlp.view(h.shape), layer.mlp(h))
