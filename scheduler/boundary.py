"""The boundary analysis: where a SubGraph's sites are.

A collective (or a user op with several implementations) is an *anchor*. Around it the boundary
analysis finds the nodes that may fuse with it: the prologue chain (elementwise producers used only
by it) and the epilogue chain (its consumers, in order). Anchor plus chains is a `Site`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from infini_dist.scheduler import op_registry
from infini_dist.scheduler.ir import SubGraph


@dataclass(frozen=True)
class Site:
    """Anchors (one op, or several coalesced all_reduces) plus their fusable neighbours.

    All fields are node indices into the owning graph, in execution order.
    """
    anchors: tuple[int, ...]
    prologue: tuple[int, ...]
    epilogue: tuple[int, ...]
    prologue_of: tuple[tuple[int, ...], ...] = field(default=())  # prologue chain per anchor
    # Independent work right before the site (fusion type "overlap"), which a choice may run
    # while the collective is in flight; every other choice runs it first, as it is.
    beside: tuple[int, ...] = ()

    @property
    def region(self) -> tuple[int, ...]:
        return self.beside + self.prologue + self.anchors + self.epilogue

    @property
    def first(self) -> int:
        return self.region[0]

    @property
    def last(self) -> int:
        return self.region[-1]


def is_anchor(graph: SubGraph, index: int) -> bool:
    return op_registry.get_op(graph.nodes[index].op_type).is_anchor


def prologue_chain(graph: SubGraph, anchor: int) -> tuple[int, ...]:
    """Elementwise producers, walked back along each node's first input, whose every output is
    read only by the next node of the chain (and is not a graph output). Producer first. Before
    an all_reduce the chain may start with the matmul that makes the partial sums (the
    row-parallel projection): a graph holds a matmul node only where the user or the compile
    pass (config.matmul_prologue) put one there."""
    users = graph.consumers()
    producer = graph.producers()
    outputs = set(graph.output_names)
    chain: list[int] = []
    current = anchor
    # A coalesced all_reduce has several inputs; walking one of them would hide the others.
    if len(graph.nodes[anchor].inputs) != 1:
        return ()
    anchor_op = graph.nodes[anchor].op_type
    position = op_registry.PROLOGUE_POSITION.get(anchor_op, "prologue")
    while True:
        source = graph.nodes[current].inputs[0]
        index = producer.get(source)
        if index is None:
            break
        node = graph.nodes[index]
        head = (anchor_op in op_registry.MATMUL_ANCHORS
                and op_registry.may_fuse(node.op_type, "matmul_prologue"))
        if not (head or op_registry.may_fuse(node.op_type, position)):
            break
        private = all(users.get(name, []) == [current] and name not in outputs
                      for name in node.outputs)
        if not private:
            break
        chain.append(index)
        if head:
            break  # the chain's head: a GEMM reads its input whole, not elementwise
        current = index
    return tuple(reversed(chain))


def epilogue_chain(graph: SubGraph, anchors: tuple[int, ...]) -> tuple[int, ...]:
    """Nodes right after the last anchor that read a value of the site and may fuse as an
    epilogue; every other input must exist before the site runs. Stops at the first node that
    does not qualify, so the chain is contiguous and the site can run as one unit."""
    producer = graph.producers()
    live = {name for a in anchors for name in graph.nodes[a].outputs}
    start = anchors[0]
    chain: list[int] = []
    for index in range(anchors[-1] + 1, len(graph.nodes)):
        node = graph.nodes[index]
        if is_gather_tail(graph, anchors, chain, index):
            chain.append(index)  # the span ends with the gather
            break
        if not op_registry.may_fuse(node.op_type, "epilogue"):
            break
        if not any(name in live for name in node.inputs):
            break
        side_ready = all(name in live or producer.get(name, -1) < start for name in node.inputs)
        if not side_ready:
            break
        chain.append(index)
        live.update(node.outputs)
    return tuple(chain)


def is_gather_tail(graph: SubGraph, anchors: tuple[int, ...], epilogue, index: int) -> bool:
    """Whether node `index` is the all_gather that ends a sequence-parallel span: a
    reduce_scatter, an epilogue on the shard, then the gather of an epilogue value over the same
    group (reduce_scatter -> add + RMSNorm -> all_gather, the norm between two linears)."""
    node, anchor = graph.nodes[index], graph.nodes[anchors[0]]
    if (node.op_type != "all_gather" or anchor.op_type != "reduce_scatter" or not epilogue
            or node.attr("group_name") != anchor.attr("group_name")):
        return False
    return node.inputs[0] in {n for i in epilogue for n in graph.nodes[i].outputs}


def beside_run(graph: SubGraph, first: int, last: int, taken: set) -> tuple[int, ...]:
    """The nodes right before node `first` that may run beside a collective (op_registry's
    "beside" position: a weight-gradient GEMM), none in `taken`; none where a node up to `last`
    (the site's last) reads one of them: the work must not feed the site."""
    start = first
    while (start > 0 and start - 1 not in taken
           and op_registry.may_fuse(graph.nodes[start - 1].op_type, "beside")):
        start -= 1
    made = {name for i in range(start, first) for name in graph.nodes[i].outputs}
    if any(made.intersection(graph.nodes[i].inputs) for i in range(first, last + 1)):
        return ()
    return tuple(range(start, first))


def _coalescable_runs(graph: SubGraph) -> list[tuple[int, ...]]:
    """Maximal runs of adjacent all_reduces on one group, none reading another's output."""
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    for index, node in enumerate(graph.nodes):
        joinable = False
        if node.op_type == "all_reduce" and current:
            head = graph.nodes[current[0]]
            produced = {n for i in current for n in graph.nodes[i].outputs}
            joinable = (current[-1] == index - 1 and node.attrs == head.attrs
                        and not produced.intersection(node.inputs))
        if joinable:
            current.append(index)
            continue
        if len(current) > 1:
            runs.append(tuple(current))
        current = [index] if node.op_type == "all_reduce" else []
    if len(current) > 1:
        runs.append(tuple(current))
    return runs


def find_sites(graph: SubGraph, fusion_types: Iterable[str] = ("epilogue", "prologue",
                                                               "cross_subgraph", "overlap")
               ) -> list[Site]:
    """Every anchor of the graph with its boundary, in execution order. Regions never overlap."""
    fusion_types = set(fusion_types)
    grouped: dict[int, tuple[int, ...]] = {}
    if "cross_subgraph" in fusion_types:
        for run in _coalescable_runs(graph):
            for index in run:
                grouped[index] = run
    sites: list[Site] = []
    seen: set[int] = set()
    for index in range(len(graph.nodes)):
        if index in seen or not is_anchor(graph, index):
            continue
        anchors = grouped.get(index, (index,))
        seen.update(anchors)
        op_type = graph.nodes[index].op_type
        per_anchor = tuple(prologue_chain(graph, a) if "prologue" in fusion_types else ()
                           for a in anchors)
        if op_type not in op_registry.PROLOGUE_POSITION:  # user ops fuse only epilogues
            per_anchor = tuple(() for _ in anchors)
        # A gather's outputs are whole tensors the next (column-parallel) matmul reads.
        epilogue = (epilogue_chain(graph, anchors)
                    if "epilogue" in fusion_types and op_type != "all_gather" else ())
        seen.update(epilogue)  # a span's closing all_gather is no anchor of its own
        prologue = tuple(sorted(i for chain in per_anchor for i in chain))
        beside = ()
        if "overlap" in fusion_types and op_type == "all_reduce" and len(anchors) == 1:
            beside = beside_run(graph, min(prologue + anchors), max(anchors + epilogue), seen)
            seen.update(beside)
        sites.append(Site(anchors, prologue, epilogue, per_anchor, beside))
    return sites


def live_outputs(graph: SubGraph, covered: Iterable[int]) -> tuple[str, ...]:
    """Values produced inside `covered` that something outside it (or the graph) still reads."""
    covered = set(covered)
    users = graph.consumers()
    outputs = set(graph.output_names)
    live = []
    for index in sorted(covered):
        for name in graph.nodes[index].outputs:
            readers = users.get(name, [])
            if name in outputs or any(r not in covered for r in readers):
                live.append(name)
    return tuple(live)


def external_inputs(graph: SubGraph, covered: Iterable[int]) -> tuple[str, ...]:
    """Values that nodes in `covered` read but do not produce, in first-use order."""
    covered = sorted(set(covered))
    produced = {n for i in covered for n in graph.nodes[i].outputs}
    seen: list[str] = []
    for index in covered:
        for name in graph.nodes[index].inputs:
            if name not in produced and name not in seen:
                seen.append(name)
    return tuple(seen)


def site_subgraph(graph: SubGraph, site: Site) -> SubGraph:
    """The site's region as a graph of its own: its signature is the same wherever it occurs."""
    region = sorted(site.region)
    return SubGraph(tuple(graph.nodes[i] for i in region), external_inputs(graph, region),
                    live_outputs(graph, region))
