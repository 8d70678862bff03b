"""Compiled code that compiles itself again once its sites have decided (compile_model).

Code compiled before a site decides runs the site through our op whatever it decides. Decided
native there, the site costs NCCL plus a Dynamo-compiled epilogue called from Python: more
host time per site and call than Inductor's own code (docs/benchmarks.md has the figures), and
an op boundary Inductor cannot fuse across. Compiled again, the pass
leaves such a site to Inductor (compile/decided.py). So what compile_model returns drops its
compiled code at its first call after a compiled site of this process commits a choice that
changes what the pass writes (native, or our collective with nothing fused: STORE.digest), and
Dynamo compiles it anew; at most MAX_RECOMPILES times, since a server meets
new token buckets for a long while (infini_dist.warmup decides them all first). Decisions of
sites compiled with a symbolic token count change nothing the pass writes (they have no
bucket), so they never cause a compile.

Decisions are agreed across each site's group and come at the same call on every rank, so every
rank compiles again at the same call, and the same graph. Only the compiled function's own code
is dropped: frames that Dynamo split off at graph breaks keep their code (they run correctly,
through our op), and so does every other compiled function.
"""

from __future__ import annotations

import functools

import torch
from torch._dynamo.eval_frame import OptimizedModule, remove_from_cache

from infini_dist.scheduler.store import STORE

MAX_RECOMPILES = 4


def _should_drop(state: dict) -> bool:
    seen = STORE.version  # one int compare per call; the digest only on a change
    if seen == state["seen"] or state["recompiles"] >= MAX_RECOMPILES:
        return False
    if torch.compiler.is_compiling() or (torch.cuda.is_available()
                                         and torch.cuda.is_current_stream_capturing()):
        return False  # called from inside other compiled code or a capture: next time
    state["seen"] = seen
    digest = STORE.digest(static_only=True)
    if digest == state["digest"]:
        return False  # decisions of dynamic-shape sites: compiling again would change nothing
    state["digest"] = digest
    state["recompiles"] += 1
    return True


class RecompilingModule(OptimizedModule):
    """torch.compile's module wrapper, recompiling as the module docstring says."""

    def __call__(self, *args, **kwargs):
        state = self.__dict__["_infini_dist_state"]
        if _should_drop(state):
            remove_from_cache(self._orig_mod)
        return super().__call__(*args, **kwargs)


def recompiling(compiled, original):
    """`compiled` (torch.compile of `original`) made to recompile as decisions come."""
    state = {"seen": STORE.version, "digest": STORE.digest(static_only=True),
             "recompiles": 0}
    if isinstance(compiled, OptimizedModule):
        compiled.__class__ = RecompilingModule
        object.__setattr__(compiled, "_infini_dist_state", state)  # not the wrapped module's
        return compiled

    @functools.wraps(original)
    def call(*args, **kwargs):
        if _should_drop(state):
            remove_from_cache(original)
        return compiled(*args, **kwargs)
    call.recompile_state = state
    return call


def recompiles(compiled) -> int:
    """How many times `compiled` (from compile_model) dropped its code so far."""
    state = (compiled.__dict__.get("_infini_dist_state") if isinstance(compiled, OptimizedModule)
             else getattr(compiled, "recompile_state", None))
    return state["recompiles"] if state else 0
