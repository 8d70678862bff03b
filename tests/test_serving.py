"""Serving: token buckets (one decision per bucket, tuned once at its bound), the warm-up API
(decisions persisted; after it, no tuning for warmed buckets; a bar on rank 0 only), and
`tune_at_request_time=False` (a miss raises on every rank)."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch

import infini_dist
from infini_dist.scheduler import buckets
from multirank import run_ranks

FAST = {"INFINI_DIST_BENCHMARK_REPS": "2", "INFINI_DIST_BENCHMARK_WARMUP": "1"}
HIDDEN = 16


# ---- the bucket function -------------------------------------------------------------------------

def test_default_buckets_are_powers_of_two_up_to_the_cap():
    with infini_dist.config.patch(max_token_bucket=64):
        s = infini_dist.config.snapshot()
        assert buckets.bounds(s) == (1, 2, 4, 8, 16, 32, 64)
        assert [buckets.bucket_of(n, s) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
        assert buckets.bucket_of(65, s) == 65 and buckets.bucket_of(1000, s) == 1000
    with infini_dist.config.patch(max_token_bucket=48):  # a cap that is no power of two
        assert buckets.bounds(infini_dist.config.snapshot())[-3:] == (16, 32, 48)


def test_configured_buckets_and_their_validation(monkeypatch):
    with infini_dist.config.patch(token_buckets=(4, 16, 128), max_token_bucket=100):
        s = infini_dist.config.snapshot()
        assert buckets.bounds(s) == (4, 16)  # the cap drops 128
        assert [buckets.bucket_of(n, s) for n in (1, 4, 5, 16, 17)] == [4, 4, 16, 16, 17]
    for bad in ((4, 4), (8, 2), (0,), ("x",), (2.5,)):
        with pytest.raises(ValueError):
            infini_dist.config.token_buckets = bad
    monkeypatch.setenv("INFINI_DIST_TOKEN_BUCKETS", "2, 8,32")
    monkeypatch.setenv("INFINI_DIST_TUNE_AT_REQUEST_TIME", "0")
    try:
        infini_dist.config.reset()
        assert infini_dist.config.token_buckets == (2, 8, 32)
        assert infini_dist.config.tune_at_request_time is False
    finally:
        monkeypatch.delenv("INFINI_DIST_TOKEN_BUCKETS")
        monkeypatch.delenv("INFINI_DIST_TUNE_AT_REQUEST_TIME")
        cache_dir = infini_dist.config.cache_dir
        infini_dist.config.reset()
        infini_dist.config.cache_dir = cache_dir


def test_token_rows_and_inputs_at_the_bucket_bound():
    s = infini_dist.config.snapshot()
    x = torch.randn(2, 3, HIDDEN)
    values = {"x": x, "residual": torch.randn(6, HIDDEN), "weight": torch.randn(HIDDEN)}
    tokens = buckets.tokens_of(values, s)
    assert (tokens.rows, tokens.bound, tokens.names) == (6, 8, ("x", "residual"))
    grown = buckets.at_bound(values, tokens)
    assert grown["x"].shape == (1, 8, HIDDEN) and grown["residual"].shape == (8, HIDDEN)
    flat = x.reshape(6, HIDDEN)
    assert torch.equal(grown["x"][0], torch.cat([flat, flat[:2]]))  # real rows, repeated
    assert grown["weight"] is values["weight"]
    assert buckets.tokens_of({"w": torch.randn(HIDDEN)}, s) is None  # no token dim: exact
    # Two layouts of one count share a bucket signature; another bucket does not.
    assert buckets.signature(values, tokens) == buckets.signature(
        dict(values, x=torch.randn(8, HIDDEN).view(1, 8, HIDDEN)), tokens)
    other = {"x": torch.randn(9, HIDDEN)}
    assert buckets.signature(other, buckets.tokens_of(other, s)) != buckets.signature(
        {"x": torch.randn(8, HIDDEN)}, buckets.tokens_of({"x": torch.randn(8, HIDDEN)}, s))


# ---- one decision per bucket, on 2 gloo ranks ----------------------------------------------------

def _inputs(rank, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    residual = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
    return x * (rank + 1), residual, weight


def _expected(world, tokens):
    x, residual, weight = _inputs(0, tokens)
    h = x * sum(r + 1 for r in range(world)) + residual
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight, h


def _run_op(rank, world, tokens, dtype=torch.float32):
    from infini_dist.ops import all_reduce_add_rms_norm
    x, residual, weight = (t.to(dtype) for t in _inputs(rank, tokens))
    out, h = all_reduce_add_rms_norm(x, residual, weight)
    ref_out, ref_h = _expected(world, tokens)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-5)
    return out


def bucket_rank(rank, world):
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.cache import DECISIONS
    from infini_dist.scheduler.choices import register_algorithm
    from infini_dist.scheduler.torch_fused import TorchFusedAllReduce

    class RowsOf4(TorchFusedAllReduce):
        name = "rows_of_4"

        def supports(self, span, meta, ctx):
            source = span.graph.nodes[span.anchors[0]].inputs[0]
            rows = meta[source].shape[0] if source in meta else 0
            return super().supports(span, meta, ctx) and rows % 4 == 0

    register_algorithm("all_reduce", "cpu", RowsOf4())
    STORE.timing_hook = lambda m: {n: (1e-9 if n.startswith("rows_of_4") else t)
                                    for n, t in m.items()}
    seen = []
    for tokens in (3, 4, 2, 4, 5, 8, 1, 6):
        out = _run_op(rank, world, tokens)
        seen.append((tokens, DECISIONS.misses, out))
    runner = STORE.entries["all_reduce_add_rms_norm"].executor.site_runners()[0]
    committed = {key[1][0][0]: choice.name for key, choice in runner._committed.items()}
    files = sorted(os.listdir(infini_dist.config.cache_dir))
    return seen, committed, files, runner.last_tuning


def test_counts_in_one_bucket_share_one_tuning_and_fall_back_agreed():
    results = run_ranks(bucket_rank, 2, env=FAST, timeout=240)
    for seen, committed, files, record in results:
        # buckets 4 (3, 4), 2, 8 (5, 8, 6), 1: four tunings for eight calls
        assert [m for _, m, _ in seen] == [1, 1, 2, 2, 3, 3, 4, 4]
        # Tuned at the bound 8 (rows_of_4 wins there); 5 and 6 cannot run it: the baseline.
        assert committed[8].startswith("rows_of_4") and committed[4].startswith("rows_of_4")
        assert committed[5] == committed[6] == "native"
        assert record["bucket"] == 1 and record["op"] == "all_reduce+add_rms_norm"
        assert record["world_size"] == 2 and record["shapes"][0] == [1, HIDDEN]
    assert len(results[0][2]) == 4  # one disk record per bucket, on rank 0
    assert results[0][1] == results[1][1]
    for (t0, _, a), (t1, _, b) in zip(results[0][0], results[1][0]):
        assert t0 == t1 and torch.equal(a, b)  # bitwise identical across ranks


def mismatched_counts(rank, world):
    from infini_dist.ops import all_reduce_add_rms_norm
    from infini_dist.scheduler.control import RankMismatchError
    _run_op(rank, world, 8)  # bucket 8 is decided on both ranks
    messages = []
    for rows in (5 + rank, 8):  # 5 and 6 share bucket 8: still agreed before anything runs
        try:
            x, residual, weight = (t.float() for t in _inputs(rank, rows))
            all_reduce_add_rms_norm(x, residual, weight)
            messages.append("no error")
        except RankMismatchError as error:
            messages.append(str(error))
    return messages


def test_counts_that_differ_across_ranks_in_one_bucket_give_a_clear_error():
    for first, after in run_ranks(mismatched_counts, 2, env=FAST, timeout=240):
        assert "disagree" in first and "(5, 16)" in first and "(6, 16)" in first, first
        assert after == "no error"  # the group is still usable


# ---- warm-up, then serving that never tunes ------------------------------------------------------

def warm_rank(rank, world, counts):
    from infini_dist.scheduler.cache import DECISIONS
    from infini_dist.scheduler.engine import TuningError

    def model(x, residual, weight):
        from infini_dist.ops import all_reduce_add_rms_norm
        return all_reduce_add_rms_norm(x, residual, weight)

    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        summary = infini_dist.warmup(model, lambda n: tuple(t.float() for t in _inputs(rank, n)),
                                     token_counts=counts)
        shown = sys.stderr.getvalue()
    finally:
        sys.stderr = stderr
    misses = DECISIONS.misses
    with infini_dist.config.patch(tune_at_request_time=False):
        for tokens in (1, 3, 4, 5, 8, 17, 20, 32):  # every one in a warmed bucket
            _run_op(rank, world, tokens)
        served_misses = DECISIONS.misses - misses
        try:
            _run_op(rank, world, 2)  # bucket 2 was not warmed
            error = None
        except TuningError as exc:
            error = str(exc)
    return summary, shown, served_misses, error, sorted(os.listdir(infini_dist.config.cache_dir))


def serve_rank(rank, world):
    from infini_dist.scheduler.cache import DECISIONS
    with infini_dist.config.patch(tune_at_request_time=False):
        for tokens in (7, 30, 1):
            _run_op(rank, world, tokens)
    return DECISIONS.misses, DECISIONS.hits


def test_warmup_persists_and_serving_never_tunes(tmp_path):
    cache = str(tmp_path / "cache")
    results = run_ranks(warm_rank, 2, [1, 3, 8, 20], env=FAST, cache_dir=cache, timeout=240)
    for rank, (summary, shown, served_misses, error, files) in enumerate(results):
        assert summary["token_counts"] == [1, 3, 8, 20]
        assert summary["tuned"] == 4 and summary["cached"] == 0  # buckets 1, 4, 8, 32
        assert served_misses == 0
        assert error is not None and "tune_at_request_time" in error  # on every rank
        if rank == 0:
            assert "infini_dist warm-up" in shown and shown.count("infini_dist: tuned") == 4
            assert len(files) == 4
        else:
            assert shown == ""  # no bar and no lines off rank 0
    # A fresh job on the same cache serves every warmed bucket from disk, tuning nothing.
    for misses, hits in run_ranks(serve_rank, 2, env=FAST, cache_dir=cache, timeout=240):
        assert misses == 0 and hits == 3


def test_warmup_resizes_example_inputs_and_checks_its_arguments():
    calls = []
    summary = infini_dist.warmup(lambda a, b: calls.append((a.shape, b)),
                                 (torch.randn(2, 5, 3), "kept"), token_counts=[4, 1, 4],
                                 token_dim=1, progress=False)
    assert summary["token_counts"] == [1, 4] and summary["tuned"] == 0
    assert calls == [(torch.Size([2, 1, 3]), "kept"), (torch.Size([2, 4, 3]), "kept")]
    with pytest.raises(ValueError):
        infini_dist.warmup(lambda x: x, torch.randn(2), token_counts=[0])
