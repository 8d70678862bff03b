"""launch/bench_split_units.py's sites (Llama-3-8B at TP = world, both layouts) and the ways
the chain times each (scheduler/split_ways.Ways): the split's variants, the column parts only
where every reader's width stays 16-byte aligned in halves. The timing itself needs GPUs."""

from __future__ import annotations

import pytest
import torch

from infini_dist.launch.bench_split_units import units
from infini_dist.scheduler.ir import subgraph_from_text
from infini_dist.scheduler.split_chain import ChainRunner, ChainSite, chain_text
from infini_dist.scheduler.split_ways import Ways

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world", [2, 4])
def test_units_are_llama_3_8b_sites_at_tp(world):
    sites = units("g0", 2048, world)
    assert {n: (s.k, [r[0] for r in s.readers]) for n, s in sites.items()} == {
        "hf_o_proj": (4096 // world, [14336 // world] * 2),
        "fused_o_proj": (4096 // world, [2 * 14336 // world]),
        "hf_down": (14336 // world, [4096 // world, 1024 // world, 1024 // world]),
        "fused_down": (14336 // world, [6144 // world])}
    ops = [n.op_type for n in subgraph_from_text(sites["hf_down"].site).nodes]
    assert ops == ["matmul", "all_reduce", "add_rms_norm"]


def _ways(site):
    runner = ChainRunner(chain_text("g0", torch.float32, [site]), None)
    return [c.name for c in Ways(runner, 0, torch.device("cpu")).choices]


def test_the_chain_times_the_splits_variants_per_site():
    sites = units("g0", 64, 2)  # the sizes matter only for the column parts' alignment
    assert _ways(sites["hf_o_proj"]) == ["sites", "split", "split_first", "split_cols",
                                         "split_first_cols"]
    assert _ways(sites["fused_down"]) == ["sites", "split", "split_cols"]
    odd = ChainSite(sites["fused_down"].site, 64, 32, 16, True, 1e-6, True,
                    ((24, True, False), (32, True, True)))
    assert _ways(odd) == ["sites", "split", "split_first"]  # 24 / 2 is not 8-aligned
    copy = ChainSite(sites["fused_down"].site, 64, 32, 16, True, 1e-6, False, ())
    assert _ways(copy) == ["sites", "split"]
