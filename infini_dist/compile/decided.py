"""What the pass does with a site whose decision is already known when its graph compiles.

A site that commits `native` runs NCCL and the epilogue as Inductor compiles it, but inside our
custom op: the op's dispatch costs host time (a host-bound training forward leaves the GPU idle
for it; docs/benchmarks.md has the measurements), and the op boundary
keeps Inductor from fusing the epilogue with its neighbours. A site that commits a bare
collective (our all-reduce, nothing fused) runs its chains in eager torch, one kernel per op,
where Inductor would fuse them. Decisions are made at run time, so the pass cannot know them
when it first compiles a graph; when a graph compiles again in the same process (after a warm-up
step: torch._dynamo.reset() and compile again), the pass

  - leaves a site decided native as Inductor's own code. Its tuning timed our collectives alone
    too, each with the rest of the site compiled by Inductor as native's is
    (scheduler/native_inductor.py), and they lost: the collective alone, as a site of its own,
    would only decide native again, one compile later,
  - replaces only the collective of a site decided bare (our collective, nothing fused), if the
    site has chains: that bare site decides at run time (our all-reduce or NCCL) and its chains
    are Inductor's. Decided native, it is left to Inductor at the next compile,
  - but writes a site of a row-split chain that committed the split (scheduler/split_chain.py)
    as a site again, whatever it decided alone, so that the chain forms again.

Only this process's decisions count: they were agreed across each site's group, so every rank
compiles the same graph (a decision-cache file may exist on one host only, and ranks compiling
different graphs would wait on each other's collectives).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from infini_dist.scheduler.op_registry import generation
from infini_dist.scheduler.settings import Settings
from infini_dist.scheduler.store import STORE, Decision


def _example(node) -> torch.Tensor | None:
    """The node's fake value, where every dim is a plain int (a symbolic token count has no
    bucket yet)."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape):
        return value
    return None


def known_choice(text: str, inputs: list, settings: Settings) -> Decision | None:
    """What site `text` (a single site), read from graph values `inputs`, committed for
    their token bucket in this process, or None."""
    values = [_example(n) for n in inputs]
    if any(v is None for v in values):
        return None
    STORE.note_static(text)  # only its decisions are worth compiling again for
    bound = STORE.bound.get(text)  # a site with run-time attributes: the one value set it met
    if bound is not None:
        if len(bound) != 1:
            return None
        (text,) = bound.values()
    executor = STORE.sites.get((text, settings, generation()))
    if executor is None:
        return None
    runners = executor.site_runners()
    if len(runners) != 1:
        return None
    return runners[0].decided(dict(zip(executor.graph.input_names, values)))


def written(forms: list, settings: Settings) -> tuple[int, bool]:
    """Which form of a site the pass writes, and whether that one is decided native (left to
    Inductor). `forms`: (text, inputs) of the whole site, then, if it has more than its anchor,
    of its collective alone. The whole site is written unless it was decided native (left to
    Inductor whole) or bare (a collective of ours, nothing fused); then its collective alone,
    whose own decision counts."""
    if _split_owned(*forms[0]):
        return 0, False
    choice = known_choice(*forms[0], settings)
    if choice is None or not choice.rewrites(len(forms) > 1):
        return 0, False
    if choice.native:
        return 0, True
    alone = known_choice(*forms[1], settings)
    return 1, alone is not None and alone.native


def _split_owned(text: str, inputs: list) -> bool:
    """Whether site `text` (inputs x, w, residual, norm weight) belongs to a row-split chain
    committed at these rows (scheduler/split_chain.py): its own decision does not count."""
    if not STORE.split_sites or len(inputs) != 4:
        return False
    residual = _example(inputs[2])
    if residual is None or residual.dim() == 0:
        return False
    return (text, residual.numel() // residual.shape[-1]) in STORE.split_sites
