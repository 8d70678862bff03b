"""The walk every site shares in a post-grad FX graph: an anchor's prologue and epilogue chains,
and trimming the site until it can be one op.

A site is an anchor (a functional all_reduce, reduce_scatter or all_gather with its wait, or a
call to a user op registered with infini_dist) plus what may fuse with it, in IR ops:

    prologue: producers that feed only the collective (walked back along input 0): elementwise
              ops before a reduction, norms too before an all_gather (they run on whole rows);
              a chain may start with a head the anchor's kind allows (an all_reduce's matmul)
    anchors:  the collective, or several adjacent independent all_reduces on one group
    epilogue: the ops after it that read the site's values, in graph order; their other inputs
              must not depend on the site

What one anchor kind adds lives with that kind, pattern and replacement side by side:
compile/all_reduce_match.py (coalescing, the matmul head of compile/matmul_match.py) and
compile/scatter_gather_match.py (the all_gather that closes a reduce_scatter's span, no epilogue
after an all_gather). A registered user op's site is this walk alone (`find_site` here). Each
kind module composes `with_prologues`, `grow_epilogue` and `trim`; none of them calls back.

The whole site becomes one op placed after its last compute node, so the site is trimmed (last
epilogue op first, then the last coalesced anchor) until every value read outside it is read
after that point, and no other collective is crossed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from infini_dist.scheduler.settings import Settings
from infini_dist.scheduler import op_registry
from infini_dist.compile import fx_patterns
from infini_dist.compile.anchors import FxOp, is_collective, is_tensor, value_of

@dataclass
class FxSite:
    """One match in an FX graph: fx nodes, not the engine's scheduler/boundary.Site indices."""
    anchors: list
    prologue_of: list  # per anchor, its prologue ops, producer first
    epilogue: list = field(default_factory=list)
    beside: list = field(default_factory=list)  # independent work (scheduler/boundary.py's Site)

    @property
    def ops(self) -> list:
        return (self.beside + [op for chain in self.prologue_of for op in chain] + self.anchors
                + self.epilogue)

    @property
    def nodes(self) -> frozenset:
        return frozenset(n for op in self.ops for n in op.nodes)



# ---- matching ops --------------------------------------------------------------------------------

class GraphIndex:
    """Positions and dependence queries over a graph that is not changing."""

    def __init__(self, graph: fx.Graph, custom: frozenset, run_time_scalars: bool = True):
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.custom = custom
        # whether an op's attribute may be a value the site reads when it runs
        # (fx_patterns.RunTimeScalar); compile/passes.py says where it may not
        self.run_time_scalars = run_time_scalars

    def match_at(self, template, root: fx.Node):
        match = fx_patterns.match_at(template, root)
        if match is None or (match.reads_run_time_scalars and not self.run_time_scalars):
            return None
        return match

    def depends_on(self, value, region: frozenset) -> bool:
        """Whether `value` is computed from any node of `region`."""
        if not isinstance(value, fx.Node) or not region:
            return False
        start = min(self.order[n] for n in region)
        seen, stack = set(), [value]
        while stack:
            node = stack.pop()
            if node in region:
                return True
            if node in seen or self.order[node] < start:
                continue
            seen.add(node)
            stack.extend(node.all_input_nodes)
        return False


def _key(node):
    val = value_of(node)
    return (val.dtype, val.dim(), val.device.type)


def _ir_op(match: fx_patterns.Match, first: fx.Node | None) -> FxOp | None:
    """The IR op for a match; a commutative op takes `first` as its first input. The IR refs
    round to input 0's dtype, so the graph's result must have that dtype."""
    inputs = list(match.inputs)
    if match.form.commutative and first is not None and inputs[0] is not first:
        inputs.reverse()
    if not all(is_tensor(n) for n in inputs + [match.root]):
        return None
    dtype = value_of(inputs[0]).dtype
    if value_of(match.root).dtype != (match.form.out_dtype or dtype) or not dtype.is_floating_point:
        return None
    form = match.form
    if any(value_of(n).dtype != dtype for i, n in enumerate(inputs)
           if i not in form.vectors + form.scalars):
        return None  # a norm's weight may have its own dtype
    if not all(_per_tensor(value_of(inputs[0]), value_of(inputs[i])) for i in form.scalars):
        return None
    if value_of(inputs[0]).device.type != "cpu" and any(
            fx_patterns.is_run_time_scalar(n) for n in inputs[1:]):
        return None  # a kernel on the GPU cannot read it; as an attribute it can (`scale`'s)
    if any(match.further[i - 1] is not None and value_of(match.further[i - 1]).dtype
           != torch.float32 for i in form.per_row_outputs):
        return None  # per-token scales computed in half precision: not the IR op's fp32 ones
    return FxOp(match.form.op_type, inputs, [match.root, *match.further], dict(match.attrs),
                match.nodes)


def _per_tensor(x, scalar) -> bool:
    """Whether `scalar` is a per-tensor operand of x's op as the IR means it: one float element
    that changes neither x's shape nor the dtype the op computes in (a [1]-shaped fp64 scale
    would promote an fp32 x: another computation)."""
    return (scalar.numel() == 1 and scalar.dtype.is_floating_point and scalar.dim() <= x.dim()
            and torch.result_type(x, scalar) == x.dtype)


def _preferred(match, other) -> bool:
    """Whether `other` is the better match: it covers more (gelu, not the x * 0.5 inside it),
    or the same without reading an attribute at run time (quant_fp8's scale as the tensor it
    is, not an attribute that each value would tune anew)."""
    return match.nodes < other.nodes or (match.nodes == other.nodes and (
        match.reads_run_time_scalars and not other.reads_run_time_scalars))


def _best(found: list) -> tuple | None:
    """The earliest (match, op) than which no other is `_preferred`."""
    for match, op in found:
        if not any(_preferred(match, other) for other, _ in found):
            return match, op
    return None


def _prologue(g: GraphIndex, anchor: FxOp, region: frozenset, depth: int, head) -> list:
    """The anchor's prologue chain, producer first; `head(value, consumers)`, if given: the op
    that may start the chain where no elementwise op matches (all_reduce_match: the matmul)."""
    position = op_registry.PROLOGUE_POSITION[anchor.op_type]
    chain: list = []
    consumer_nodes = anchor.nodes
    value = anchor.inputs[0]
    while len(chain) < depth:
        if (not isinstance(value, fx.Node) or value.op != "call_function" or not is_tensor(value)
                or any(u not in consumer_nodes for u in value.users)):
            break
        found = []
        for template in fx_patterns.templates(*_key(value)):
            if not op_registry.may_fuse(template.form.op_type, position):
                continue
            match = g.match_at(template, value)
            # A prologue's values are private to the site: no interior value read elsewhere
            # (a training graph's saved rsqrt), no second output.
            if (match is not None and not match.nodes & region and match.exposed is None
                    and not any(n is not None for n in match.further)):
                found.append(match)
        match = max(found, key=lambda m: (len(m.nodes), not m.reads_run_time_scalars),
                    default=None)
        if match is None:
            op = head(value, consumer_nodes) if head is not None else None
            if op is not None and not op.nodes & region:
                chain.append(op)  # the chain's head: nothing before a GEMM joins the site
            break
        # Continue through the input this op alone reads, if there is one.
        private = [n for n in match.inputs
                   if isinstance(n, fx.Node) and all(u in match.nodes for u in n.users)]
        op = _ir_op(match, private[0] if private else None)
        if op is None:
            break
        chain.append(op)
        region = region | op.nodes
        consumer_nodes = op.nodes
        value = op.inputs[0]
    chain.reverse()
    return chain


def _candidates(live: set, region: frozenset, reach: int) -> set:
    """Nodes within `reach` steps downstream of the live values, outside the region."""
    found, frontier = set(), set(live)
    for _ in range(reach):
        frontier = {u for n in frontier for u in n.users
                    if u not in region and u.op == "call_function"} - found
        found |= frontier
    return found


def _epilogue_op(g: GraphIndex, match, live: set, region: frozenset) -> FxOp | None:
    """The IR op for an epilogue match: it reads a live value where the op allows one, and its
    other inputs exist without the site."""
    if match.nodes & region:
        return None
    chain_inputs = match.form.chain_inputs
    if not any(n in live for i, n in enumerate(match.inputs) if i in chain_inputs):
        return None
    for index, node in enumerate(match.inputs):
        if node in live:
            if index not in chain_inputs:
                return None
        elif not is_tensor(node) or g.depends_on(node, region):
            return None
    if match.exposed is not None and _exposed_op(match) is None:
        return None
    return _ir_op(match, next(n for n in match.inputs if n in live))


def _exposed_op(match) -> FxOp | None:
    """The IR op for the interior value a match exposes: the norm's fp32 rsqrt, one per row.
    It replaces no node of its own (the norm's op does) and only names that node's value."""
    op_type, _ = match.form.exposable
    source, value = value_of(match.inputs[0]), value_of(match.exposed)
    if (not isinstance(value, torch.Tensor) or value.dtype != torch.float32
            or tuple(value.shape) != tuple(source.shape[:-1]) + (1,)):
        return None
    return FxOp(op_type, [match.inputs[0]], [match.exposed], {"eps": match.attrs["eps"]},
                frozenset())


def _epilogue(g: GraphIndex, site: FxSite, depth: int) -> None:
    live = {n for a in site.anchors for n in a.outputs if n is not None}
    region = site.nodes
    keys = {_key(n) for n in live if is_tensor(n)}
    reach = max((t.size for k in keys for t in fx_patterns.templates(*k)), default=1)
    while True:
        found = []
        for node in sorted(_candidates(live, region, reach), key=g.order.get):
            for template in (t for key in keys for t in fx_patterns.templates(*key)):
                match = g.match_at(template, node)
                op = _epilogue_op(g, match, live, region) if match is not None else None
                if op is not None:
                    found.append((match, op))
        if _depth(site.epilogue) >= depth:  # at the cap only an rms_norm folding into an add
            found = [(m, op) for m, op in found if _folds_into(site.epilogue, m)]
        best = _best(found)
        if best is None:
            return
        match, op = best
        if _folds_into(site.epilogue, match):
            add = site.epilogue.pop()
            op = FxOp("add_rms_norm", [add.inputs[0], add.inputs[1], op.inputs[1]],
                      [op.outputs[0], add.outputs[0]], op.attrs, add.nodes | op.nodes)
        site.epilogue.append(op)
        if match.exposed is not None:
            site.epilogue.append(_exposed_op(match))
        region = region | op.nodes
        live |= {n for n in op.outputs if n is not None}
        keys |= {_key(n) for n in op.outputs if n is not None}


def _depth(epilogue: list) -> int:
    return sum(1 for op in epilogue if op.nodes)  # an exposed value is no op of its own


def _pop_epilogue(site: FxSite) -> None:
    """Drop the last epilogue op; an exposed value goes with the op whose nodes compute it."""
    while site.epilogue and not site.epilogue.pop().nodes:
        pass


def _folds_into(epilogue: list, match) -> bool:
    """rms_norm(x) right after x = a + b: together they are add_rms_norm(a, b)."""
    return (match.form.op_type == "rms_norm" and bool(epilogue)
            and epilogue[-1].op_type == "add" and match.inputs[0] is epilogue[-1].outputs[0])


# ---- placement and assembly ---------------------------------------------------------------------

def insertion_point(g: GraphIndex, site: FxSite) -> fx.Node:
    # beside work is placed with the site, wherever it stood (its readers all come later)
    compute = [n for op in site.ops[len(site.beside):] for n in op.nodes - op.projections]
    return max(compute, key=g.order.get)


def _fits(g: GraphIndex, site: FxSite) -> bool:
    nodes = site.nodes
    last = g.order[insertion_point(g, site)]
    for op in site.ops:
        for out in op.outputs:
            if out is not None and any(u not in nodes and g.order[u] <= last for u in out.users):
                return False
    first = min(g.order[n] for a in site.anchors for n in a.nodes)
    return not any(is_collective(n, g.custom) and n not in nodes
                   for n in g.nodes[first + 1:last])


def with_prologues(g: GraphIndex, anchors: list, settings: Settings, head=None) -> FxSite:
    """A site of `anchors` (one, or an all_reduce's coalesced group), each with its prologue
    chain where its kind has a prologue position and the flags allow one; `head` as `_prologue`
    takes it."""
    types = settings.custom_op_fusion_types
    region = frozenset(n for a in anchors for n in a.nodes)
    prologue_of = []
    with_prologue = anchors[0].op_type in op_registry.PROLOGUE_POSITION and "prologue" in types
    for a in anchors:
        chain = _prologue(g, a, region, settings.max_fusion_depth, head) if with_prologue else []
        prologue_of.append(chain)
        region = region | frozenset(n for op in chain for n in op.nodes)
    return FxSite(anchors, prologue_of)


def grow_epilogue(g: GraphIndex, site: FxSite, settings: Settings) -> None:
    """The site's epilogue, as deep as the flags allow."""
    if "epilogue" in settings.custom_op_fusion_types and settings.max_fusion_depth > 0:
        _epilogue(g, site, settings.max_fusion_depth)


def trim(g: GraphIndex, site: FxSite) -> FxSite:
    """`site` made to fit in one op: last epilogue op first, then the last coalesced anchor."""
    while not _fits(g, site):
        if site.epilogue:
            _pop_epilogue(site)
        elif len(site.anchors) > 1:
            site.anchors.pop()
            site.prologue_of.pop()
        else:
            raise AssertionError("infini_dist: a lone anchor must always fit")  # by construction
    return site


def bare_site(anchor: FxOp) -> FxSite:
    """The anchor alone: the site a bare decision (our collective, nothing fused) leaves
    (compile/decided.py). It always fits: its one compute node is the anchor, and its outputs
    are read after it."""
    return FxSite([anchor], [[]])


# ---- a registered user op's site -----------------------------------------------------------------

# A user op alone is still ours: the engine chooses among its implementations.
RUNS_ALONE = True


def find_site(g: GraphIndex, anchor: FxOp, settings: Settings) -> FxSite:
    """The site around a registered user op: its epilogue (the registry gives user ops no
    prologue position), nothing of a collective's own."""
    site = with_prologues(g, [anchor], settings)
    grow_epilogue(g, site, settings)
    return trim(g, site)
