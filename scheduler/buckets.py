"""Token buckets: one decision per bucket of a site's token count, not per exact count.

A site's token count is the rows of its main input (its first input of two or more dims: a
compiled site may list a norm weight first): the product of all dims but the last. Bucket upper
bounds are `config.token_buckets`, or powers of two when that is empty, capped at
`config.max_token_bucket`; a count above the largest bound is a bucket of its own (tuned at that
exact count: prefill sizes are few and large, and a decision for a size far from the one measured
would not be worth trusting).

A bucket is tuned at its upper bound, on inputs whose token rows are the real rows repeated
(`at_bound`): so every algorithm's size cap holds for every count in the bucket, and the
symmetric buffers a choice needs are allocated for the largest count while the ranks are in
lockstep. Counts inside a bucket then only compile the committed choice for their exact shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infini_dist.scheduler.settings import Settings


def bounds(settings: Settings) -> tuple[int, ...]:
    cap = settings.max_token_bucket
    if settings.token_buckets:
        return tuple(b for b in settings.token_buckets if b <= cap)
    powers = tuple(1 << i for i in range(cap.bit_length()) if 1 << i < cap)
    return powers + (cap,)


def bucket_of(count: int, settings: Settings) -> int:
    """The upper bound of `count`'s bucket; the count itself above the largest bound."""
    return next((b for b in bounds(settings) if b >= count), count)


@dataclass(frozen=True)
class Tokens:
    rows: int           # the token count of this call
    bound: int          # its bucket's upper bound
    names: tuple        # the inputs with those rows, each (..., last dim)


def tokens_of(values: dict, settings: Settings, fixed: frozenset = frozenset()) -> Tokens | None:
    """The token rows of a site's inputs, or None where the site has no token dim. `fixed`:
    inputs that never have token rows whatever their shape (a matmul's weight, [N, K], whose N
    may equal the token count)."""
    tensors = [(n, v) for n, v in values.items()
               if isinstance(v, torch.Tensor) and n not in fixed]
    main = next((v for _, v in tensors if v.dim() >= 2), None)
    if main is None or main.numel() == 0:
        return None
    rows = main.numel() // main.shape[-1]
    names = tuple(n for n, v in tensors if v.dim() >= 2 and math.prod(v.shape[:-1]) == rows)
    return Tokens(rows, bucket_of(rows, settings), names)


def at_bound(values: dict, tokens: Tokens) -> dict:
    """`values` with every token input grown (or kept) to the bucket bound, as (1.., bound, last):
    the real rows repeated in order, so the data stay realistic and equal where the ranks' are."""
    resized = dict(values)
    for name in tokens.names:
        value = values[name]
        index = torch.arange(tokens.bound, device=value.device) % tokens.rows
        rows = value.reshape(-1, value.shape[-1]).index_select(0, index)
        resized[name] = rows.reshape((1,) * (value.dim() - 2) + tuple(rows.shape))
    return resized


def signature(values: dict, tokens: Tokens | None) -> tuple:
    """What a bucket's decision is kept under in a runner: the exact signature with the token
    rows replaced by the bucket bound."""
    names = tokens.names if tokens else ()
    return (tokens and tokens.bound,) + tuple(
        (v.dtype, v.device, v.dim(), v.shape[-1:] if n in names else v.shape)
        if isinstance(v, torch.Tensor) else (type(v), v) for n, v in values.items())


def same_layout(values: dict, others: dict) -> bool:
    """True where a choice compiled for `others` runs `values` as they are."""
    return all(a.shape == b.shape and a.is_contiguous() == b.is_contiguous()
               if isinstance(a, torch.Tensor) else a is b
               for a, b in ((values[n], others[n]) for n in values))
