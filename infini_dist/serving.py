"""Warm-up before serving: tune every token bucket of a model or function ahead of requests.

    infini_dist.warmup(model, lambda tokens: (torch.randn(1, tokens, 4096, device=dev),))
    infini_dist.warmup(model, (example_ids,), token_counts=[1, 8, 32], token_dim=1)

Each call of `model` runs its sites (eager fused ops or compiled sites) once per token count, so
each site's bucket of that count is tuned across its group, or loaded from the cache, and its
decision persisted (rank 0 writes the disk cache). Then serving with
`config.tune_at_request_time = False` raises on any bucket that was not warmed instead of tuning.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

import infini_dist
from infini_dist.scheduler import buckets
from infini_dist.scheduler.store import STORE


def _resized(value, tokens: int, token_dim: int):
    """An example input with `tokens` entries along `token_dim`: its own entries repeated."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    index = torch.arange(tokens, device=value.device) % value.shape[token_dim]
    return value.index_select(token_dim, index)


def _call(model, args):
    if isinstance(args, dict):
        return model(**args)
    if isinstance(args, (tuple, list)):
        return model(*args)
    return model(args)


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def warmup(model, inputs, token_counts=None, *, token_dim: int = 0,
           progress: bool = True) -> dict:
    """Run `model` once per token count so every site's bucket is decided and cached.

    model:        an nn.Module or any callable (compiled or not) that runs infini_dist sites.
    inputs:       `make_inputs(tokens)` returning the call's arguments (a tuple: positional, a
                  dict: keyword, else the single argument), or example arguments in that form
                  whose tensors are resized along `token_dim` (their entries repeated).
    token_counts: counts to run; default one per bucket (`config.token_buckets` or powers of
                  two, up to `config.max_token_bucket`). A site's token count is the rows of its
                  input, so pick counts for what reaches the sites (batch x sequence).
    progress:     a tqdm bar on rank 0 (never on other ranks) with one line per tuned site.

    Collective: every rank of the model's groups calls it with the same counts. Returns
    {"token_counts", "tuned" (sites benchmarked), "cached" (decisions loaded), "seconds"}.
    """
    from tqdm import tqdm
    settings = infini_dist.config.snapshot()
    counts = sorted(set(buckets.bounds(settings) if token_counts is None else token_counts))
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"warmup: token_counts must be ints >= 1, got {token_counts!r}")
    if not isinstance(token_dim, int) or isinstance(token_dim, bool):
        raise TypeError(f"warmup: token_dim must be an int, got {token_dim!r}")

    def make(tokens):
        if callable(inputs):
            return inputs(tokens)
        if isinstance(inputs, dict):
            return {k: _resized(v, tokens, token_dim) for k, v in inputs.items()}
        if isinstance(inputs, (tuple, list)):
            return tuple(_resized(v, tokens, token_dim) for v in inputs)
        return _resized(inputs, tokens, token_dim)

    misses, hits, started = STORE.records.misses, STORE.records.hits, time.perf_counter()
    bar = tqdm(counts, desc="infini_dist warm-up", unit="shape", file=sys.stderr,
               disable=not progress or _rank() != 0)
    # Warm-up is where tuning belongs, whatever serving allows.
    allow = (infini_dist.config.patch(tune_at_request_time=True)
             if not settings.tune_at_request_time else contextlib.nullcontext())
    try:
        with allow, torch.no_grad():
            for tokens in bar:
                bar.set_postfix(tokens=tokens, tuned=STORE.records.misses - misses)
                _call(model, make(tokens))
    finally:
        bar.close()
    return {"token_counts": counts, "tuned": STORE.records.misses - misses,
            "cached": STORE.records.hits - hits, "seconds": time.perf_counter() - started}
