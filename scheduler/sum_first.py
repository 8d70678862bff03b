"""Sum first: coalesced all_reduces whose results are only added together become one all_reduce
of the summed partials, since all_reduce(a) + all_reduce(b) == all_reduce(a + b).

GPT-NeoX, Pythia, Phi-2 and Cohere run attention and MLP in parallel off one normed input
(parallel residual): both row-parallel outputs are reduced, then added with their biases and the
residual before the next norm,

    x = (all_reduce(a) + b_attn) + (all_reduce(m) + b_mlp) + residual;  layer_norm(x)

which is the same sum as

    x = all_reduce(a + m) + b_attn + b_mlp + residual

with half the bytes on the wire and one collective launch instead of two. The rewritten site is
one more source of choices: its plain form (one collective, the adds as torch runs them) and every
fused choice of it. The engine checks each against the fp32 reference of the user's own graph
(the sums round in another order: within the usual tolerance, not the same bits) and times it
against native like any other choice.
"""

from __future__ import annotations

from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.boundary import Site

PREFIX = "sum_first+"


def _sum_tree(graph: SubGraph, site: Site) -> tuple[list[int], list[str]] | None:
    """The epilogue adds that sum the anchors' results with each other and with graph inputs
    (biases, the residual), up to the first other op that reads the sum, and those inputs (the
    leaves); None unless every anchor result ends in that one sum and nothing else reads a
    partial sum on the way."""
    users = graph.consumers()
    pending = {graph.nodes[a].outputs[0] for a in site.anchors}  # summed, not yet consumed
    inputs = set(graph.input_names)
    tree, leaves = [], []
    for index in site.epilogue:
        node = graph.nodes[index]
        summed = [name for name in node.inputs if name in pending]
        if not summed:
            continue
        if node.op_type != "add" or len(set(node.inputs)) != 2:
            break  # the sum's first reader that is not one more add: the tree ends
        others = [name for name in node.inputs if name not in summed]
        if any(name not in inputs for name in others):
            return None  # a summand computed in the site would have to move before the sum
        tree.append(index)
        pending -= set(summed)
        leaves += others
        pending.add(node.outputs[0])
    if len(pending) != 1 or len(tree) < len(site.anchors) - 1:
        return None
    inner = [graph.nodes[a].outputs[0] for a in site.anchors] + \
        [graph.nodes[i].outputs[0] for i in tree[:-1]]
    if any(name in graph.output_names or len(users.get(name, [])) != 1 for name in inner):
        return None
    return tree, leaves


def rewrite(graph: SubGraph, site: Site, meta: dict) -> tuple[SubGraph, Site, dict] | None:
    """(graph, site, meta) of the sum-first form of a coalesced all_reduce site, or None where it
    does not apply: fewer than two anchors, prologues, unlike reductions, partials of another
    shape or dtype than the sum, or an anchor result read anywhere but by the sum's adds."""
    if len(site.anchors) < 2 or site.prologue:
        return None
    anchors = [graph.nodes[a] for a in site.anchors]
    if any(len(n.inputs) != 1 for n in anchors) or len({n.attrs for n in anchors}) != 1 \
            or dict(anchors[0].attrs).get("op", "sum") != "sum":
        return None
    found = _sum_tree(graph, site)
    if found is None:
        return None
    tree, leaves = found
    partials = [n.inputs[0] for n in anchors]
    root = graph.nodes[tree[-1]].outputs[0]
    root_meta = meta.get(root)
    if root_meta is None or any(meta.get(p) != root_meta for p in partials):
        return None
    fresh = [f"{root}.sum_first{k}" for k in range(len(partials) + len(leaves))]
    nodes, value = [], partials[0]
    for k, partial in enumerate(partials[1:]):  # the prologue: the partials summed locally
        nodes.append(OpNode("add", (value, partial), (fresh[k],)))
        value = fresh[k]
    reduced = fresh[len(partials) - 1]
    nodes.append(OpNode("all_reduce", (value,), (reduced,), anchors[0].attrs))
    value = reduced
    for k, leaf in enumerate(leaves):  # the epilogue: the other summands, the last one the root
        name = root if k == len(leaves) - 1 else fresh[len(partials) + k]
        nodes.append(OpNode("add", (value, leaf), (name,)))
        value = name
    if not leaves:  # the partials alone were summed: the all_reduce yields the root
        nodes[-1] = OpNode("all_reduce", nodes[-1].inputs, (root,), anchors[0].attrs)
    rest = [graph.nodes[i] for i in site.epilogue if i not in tree]
    new = SubGraph(tuple(nodes + rest), graph.input_names, graph.output_names)
    first = len(partials) - 1
    new_site = Site((first,), tuple(range(first)), tuple(range(first + 1, len(new.nodes))),
                    (tuple(range(first)),))
    new_meta = dict(meta)
    new_meta.update({name: root_meta for name in fresh})
    return new, new_site, new_meta
