"""launch/bench_knobs.py's A/B pairs, on the CPU: every pair binds both of its sides, and the two
sides launch differently (a pair that launched the same kernel twice would time nothing)."""

import torch

from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
from infini_dist.launch import bench_knobs


def test_every_pair_binds_two_different_launches():
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 16), dtype=torch.uint8)
                                for _ in range(2)], 0)
    buffer.data_bytes = 1 << 40  # bound, never launched
    knobs = set()
    for kernel, tokens, knob, *sides in bench_knobs.pairs():
        x = torch.empty(tokens, bench_knobs.HIDDEN, dtype=torch.bfloat16)
        launches = []
        for quant, tuning, warps in sides:
            _, grid, _, kwargs, _ = kernel.bind(
                x, weight=torch.ones(bench_knobs.HIDDEN, dtype=x.dtype),
                residual=torch.empty_like(x), quant=quant, tuning=tuning, buffer=buffer)
            launches.append((grid, sorted(kwargs.items()), warps))
        assert launches[0] != launches[1], (kernel.kind, tokens, knob)
        knobs.add(knob)
    assert "FP8 rows a step" in knobs
