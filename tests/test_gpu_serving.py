"""Token buckets on GPUs: after warm-up, every count of a warmed bucket runs without tuning and
without allocating a symmetric buffer (allocation is collective and may not happen at request
time, nor under capture), and graph-captured replays of counts never seen eagerly stay right."""

import pytest
import torch

from multirank import run_ranks


def _warm_then_serve(rank, world):
    import infini_dist
    from infini_dist.kernels import symm_buffers
    from infini_dist.ops import all_reduce_add_rms_norm
    from infini_dist.scheduler.cache import DECISIONS
    device = torch.device("cuda", rank)
    hidden = 4096

    def inputs(tokens, salt=0):
        gen = torch.Generator().manual_seed(tokens * 31 + salt)
        x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
        residual = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, torch.bfloat16)
        return x * (rank + 1), residual, weight

    def reference(tokens, salt=0):
        x, residual, weight = (t.double() for t in inputs(tokens, salt))
        h = x / (rank + 1) * sum(r + 1 for r in range(world)) + residual
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    summary = infini_dist.warmup(lambda *a: all_reduce_add_rms_norm(*a), inputs,
                                 token_counts=[1, 2, 4, 8, 16, 32, 64, 128], progress=False)
    buffers, misses = symm_buffers.cached_buffers(), DECISIONS.misses
    errors = []
    with infini_dist.config.patch(tune_at_request_time=False):
        for tokens in (3, 5, 7, 12, 33, 100, 127):
            out, _ = all_reduce_add_rms_norm(*inputs(tokens))
            errors.append(((out.double() - reference(tokens)).norm()
                           / reference(tokens).norm()).item())
        # A count first seen under capture runs the baseline there (no compile in a capture).
        static = inputs(9)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = all_reduce_add_rms_norm(*static)
        for _ in range(100):
            graph.replay()
        torch.cuda.synchronize()
        errors.append(((captured.double() - reference(9)).norm() / reference(9).norm()).item())
    return {"tuned": summary["tuned"], "new_buffers": symm_buffers.cached_buffers() != buffers,
            "served_misses": DECISIONS.misses - misses, "errors": errors}


@pytest.mark.multigpu
def test_warmed_buckets_serve_without_tuning_or_allocating():
    results = run_ranks(_warm_then_serve, 2, backend="nccl", timeout=600)
    for r in results:
        assert r["tuned"] == 8 and r["served_misses"] == 0
        assert not r["new_buffers"], "a symmetric buffer was allocated after warm-up"
        assert max(r["errors"]) < 1e-2, r["errors"]
