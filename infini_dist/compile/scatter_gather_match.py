"""reduce_scatter and all_gather sites: what these anchors add to the shared walk
(compile/matching.py). Sequence parallelism puts them around the norm between a row-parallel and
a column-parallel linear.

Pattern (post-grad FX):

    s = reduce_scatter_tensor(p, "sum", n, group); w = wait_tensor(s)
    h = w + residual; y = <rms_norm decomposed> * weight
    g = all_gather_into_tensor(y, n, group); out = wait_tensor(g)

  - after a reduce_scatter, an all_gather of an epilogue value on the same group closes the
    span: reduce_scatter -> add + RMSNorm -> all_gather is one site,
  - an all_gather's prologue may hold norms (they run on whole rows); its result is a whole
    tensor for the next column-parallel matmul, so it takes no epilogue. On a GPU it takes no
    prologue: our gather kernel (kernels/lamport_all_gather.py) takes the tensor as it is, so
    a norm before it stays in Inductor's fused kernel, which a site would split.

Replacement:

    out, h = infini_dist.fused_site([p, residual, weight],
                                    '<SubGraph: reduce_scatter -> add_rms_norm -> all_gather>')

A reduce_scatter with nothing to fuse is left to Inductor (RUNS_ALONE False). An all_gather alone
is a site where an algorithm of ours runs it (ALONE_WHERE_OURS; compile/passes.py,
`_ours_alone`): on a GPU lamport_all_gather, up to its cap. Elsewhere such a site could only run
NCCL, as Inductor's own code does without our op's dispatch.
"""

from __future__ import annotations

from infini_dist.compile import matching
from infini_dist.compile.anchors import FxOp, collective_anchor, speed_device
from infini_dist.scheduler.settings import Settings

OP_TYPES = ("reduce_scatter", "all_gather")
RUNS_ALONE = False
# symm_scatter_gather can run a reduce_scatter alone too, but with those sites torchtitan's SP
# training step read 1.023 and 1.012 of plain compile's median on 2 H100s (within the rounds'
# spread; 0.999 without them, session 17): not shown to pay, so they stay Inductor's.
ALONE_WHERE_OURS = frozenset({"all_gather"})


def _gather_tail(site: matching.FxSite) -> None:
    """A reduce_scatter's epilogue whose value is all-gathered over the same group: the gather
    closes the span (sequence parallelism's reduce_scatter -> add + RMSNorm -> all_gather)."""
    anchor = site.anchors[0]
    if not site.epilogue:
        return
    live = [n for op in site.epilogue for n in op.outputs if n is not None]
    for value in live:
        for user in value.users:
            gather = collective_anchor(user)
            if (gather is not None and gather.op_type == "all_gather"
                    and gather.attrs["group_name"] == anchor.attrs["group_name"]):
                site.epilogue.append(gather)
                return


def find_site(g: matching.GraphIndex, anchor: FxOp, settings: Settings) -> matching.FxSite:
    """The site around a reduce_scatter or an all_gather."""
    if anchor.op_type == "all_gather" and speed_device(anchor) is not None:
        return matching.bare_site(anchor)
    site = matching.with_prologues(g, [anchor], settings)
    if anchor.op_type == "reduce_scatter":
        matching.grow_epilogue(g, site, settings)
        _gather_tail(site)
    return matching.trim(g, site)
