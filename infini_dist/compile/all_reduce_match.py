"""all_reduce sites: what an all_reduce anchor adds to the shared walk (compile/matching.py).

Pattern (post-grad FX, after Inductor's decompositions):

    r = _c10d_functional.all_reduce(p, "sum", group); w = wait_tensor(r)
    h = w + residual; out = <rms_norm decomposed: pow, mean, add, rsqrt, mul, converts> * weight

  - with cross_subgraph, the all_reduces right after it on the same group that can run with it
    join the site (coalesced: one site, several anchors),
  - with config.matmul_prologue, the mm / addmm / linear producing `p` heads its prologue chain
    (compile/matmul_match.py),
  - with the "overlap" fusion type, the weight-gradient GEMMs that read the same output
    gradient as the GEMMs making `p` (a backward graph) join the site as work beside it
    (compile/matmul_match.py's weight_gradients).

Replacement:

    out, h = infini_dist.fused_site([p, residual, weight], '<SubGraph: all_reduce -> add_rms_norm>')

A site of the all_reduce alone is replaced too (RUNS_ALONE): our own all-reduce competes with
NCCL for it at run time.
"""

from __future__ import annotations

import torch.fx as fx

from infini_dist.compile import matching
from infini_dist.compile.anchors import FxOp, collective_anchor, is_collective
from infini_dist.compile.matmul_match import matmul_producer, weight_gradients
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.settings import Settings

OP_TYPES = ("all_reduce",)
RUNS_ALONE = True


def _next_collective(g: matching.GraphIndex, after: fx.Node):
    for node in g.nodes[g.order[after] + 1:]:
        if is_collective(node, g.custom):
            return node
    return None


def _coalesce(g: matching.GraphIndex, first: FxOp) -> list:
    """`first` and the all_reduces right after it on the same group that can run with it: their
    inputs do not depend on the group so far, and nothing reads the group's results before."""
    group = [first]
    node = next(iter(first.nodes - first.projections))
    while True:
        node = _next_collective(g, node)
        candidate = collective_anchor(node) if node is not None else None
        if (candidate is None or candidate.op_type != "all_reduce"
                or candidate.attrs != first.attrs):
            return group
        region = frozenset(n for a in group for n in a.nodes)
        if g.depends_on(candidate.inputs[0], region):
            return group
        readers = [u for a in group for out in a.outputs for u in out.users]
        if any(g.order[u] <= g.order[node] for u in readers):
            return group
        group.append(candidate)


def find_site(g: matching.GraphIndex, anchor: FxOp, settings: Settings) -> matching.FxSite:
    """The site around an all_reduce, as large as the flags allow and the graph permits."""
    coalesce = "cross_subgraph" in settings.custom_op_fusion_types
    anchors = _coalesce(g, anchor) if coalesce else [anchor]
    # The engine takes a matmul as a chain's head only before the anchors its registry names
    # (op_registry.MATMUL_ANCHORS, read by scheduler/boundary.py's prologue walk): offer it there alone.
    matmul = settings.matmul_prologue and anchor.op_type in op_registry.MATMUL_ANCHORS
    site = matching.with_prologues(g, anchors, settings, matmul_producer if matmul else None)
    matching.grow_epilogue(g, site, settings)
    site = matching.trim(g, site)
    if "overlap" in settings.custom_op_fusion_types and len(site.anchors) == 1:
        site.beside = weight_gradients(g.order, site.anchors[0].inputs[0],
                                       matching.insertion_point(g, site), site.nodes)
    return site
