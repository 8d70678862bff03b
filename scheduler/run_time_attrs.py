"""Compiled sites with attributes known only at run time: a norm's eps or a scale that the graph
reads from a 0-dim CPU tensor (compile/fx_patterns.RunTimeScalar), as Dynamo makes a Python
float under `torch.compile(dynamic=True)`.

The engine's kernels take attributes as constants, so each value a site runs with gives the
site of its own (the SubGraph with the value in its slot), which tunes and commits like any
other. Such values are a module's constants in practice (an eps, a scaling factor), so a site
meets one. One that keeps changing would tune afresh at every call: a site takes at most
`MAX_VALUES` values, and past them runs in eager torch (the collective, then torch's ops),
unfused but correct. A graph compiled again after such a site decided finds the decision by the
one value set it met (compile/decided.py).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from infini_dist.scheduler.choices import RunContext, resolve_group, run_nodes
from infini_dist.scheduler.ir import OpNode, SubGraph, subgraph_from_text
from infini_dist.scheduler.store import STORE

log = logging.getLogger("infini_dist")

MAX_VALUES = 8


def substitute(text: str, slots: tuple[str, ...], values: tuple[float, ...]) -> SubGraph:
    """The site `text` with each slot ("node index:attribute") set to its value."""
    graph = subgraph_from_text(text)
    if len(slots) != len(values):
        raise ValueError(f"infini_dist.fused_site_scalars: {len(slots)} slots, "
                         f"{len(values)} values")
    nodes = list(graph.nodes)
    for slot, value in zip(slots, values):
        index, name = slot.split(":")
        node = nodes[int(index)]
        nodes[int(index)] = OpNode(node.op_type, node.inputs, node.outputs,
                                   {**node.attr_dict, name: value})
    return SubGraph(tuple(nodes), graph.input_names, graph.output_names)


def bind(text: str, slots: tuple[str, ...], values: tuple[float, ...]) -> str | None:
    """The text of site `text` with `values` in its slots; None once it has met `MAX_VALUES`
    other values (the caller runs it eagerly)."""
    bound = STORE.bound.setdefault(text, {})
    concrete = bound.get(values)
    if concrete is None:
        if len(bound) >= MAX_VALUES:
            return None
        concrete = bound[values] = substitute(text, slots, values).canonical()
        if text in STORE.static_texts:  # its decisions rewrite the graph (compile/decided.py)
            STORE.note_static(concrete)
        if len(bound) == MAX_VALUES:
            log.warning("infini_dist: a compiled site's run-time attributes took %d values; "
                        "further values run unfused in eager torch", MAX_VALUES)
    return concrete


def run_eagerly(graph: SubGraph, inputs: list) -> list:
    """The site's nodes one by one, natively: the collective through torch.distributed on the
    group it names, the rest as torch ops."""
    group = resolve_group(next((n.attr("group_name") for n in graph.nodes
                                if n.attr("group_name")), None))
    ctx = RunContext(group, dist.get_world_size(group), dist.get_rank(group), inputs[0].device)
    env = dict(zip(graph.input_names, inputs))
    run_nodes(graph, range(len(graph.nodes)), env, ctx, native=True)
    return [env[name] for name in graph.output_names]
