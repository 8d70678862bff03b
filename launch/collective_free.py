"""The collective-free step: the benches' floor (`bench --hf`, `bench --model`, issue #26).

The same TP-sharded model, compiled exactly as the plain variant (Inductor, the same mode), but
with every functional collective in its post-grad graphs replaced by a local stand-in of the
same shape and dtype that talks to no other rank:

    all_reduce(x)             -> x                       (the rank's partial sum, unreduced)
    reduce_scatter_tensor(x)  -> x[: len(x) // group]    (a view of the rank's own partials)
    all_gather_into_tensor(x) -> cat([x] * group)        (the rank's shard, repeated)

each with the wait_tensor(s) after it. Its outputs are wrong (partial sums), so no error is
checked against eager; what it measures is a step with all of the sharded compute and none of
the communication. No all-reduce library, fused or not, can beat it: it is the floor a pass is
judged against. With the collectives gone Inductor may also fuse across where they were (an
all_reduce is a fusion boundary), which a real collective can only approach: a lower floor,
never a higher one.

Collectives are found with the pass's own matcher (infini_dist/compile/anchors.py), at the
point the infini_dist pass runs (Inductor's post_grad_custom_post_pass), so both see the same
spellings. Any collective it cannot replace (an op it does not know, a non-sum reduce, a result
read without a wait) stays and is counted in `left`: a bench must not call such a step a floor.

The pass is handed to the one torch.compile call as an Inductor option (`compile_model`), never
installed in Inductor's global config: other variants compiled in the same process keep their
collectives.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from infini_dist.compile import anchors

_OPTION = "post_grad_custom_post_pass"


def _insert(graph: fx.Graph, before: fx.Node, target, args: tuple) -> fx.Node:
    """A call of `target` inserted before `before`, with the fake value Inductor lowers from
    (fake tensors run ops through their own mode: none needs entering)."""
    def value(arg):
        if isinstance(arg, list):
            return [value(a) for a in arg]
        return arg.meta["val"] if isinstance(arg, fx.Node) else arg
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    node.meta["val"] = target(*(value(a) for a in args))
    return node


def _stand_in(graph: fx.Graph, op: anchors.FxOp, before: fx.Node) -> fx.Node:
    """The local value replacing collective `op`'s waited result: its shape, no communication."""
    source = op.inputs[0]
    if op.op_type == "all_reduce":
        return source
    group = op.attrs["group_size"]
    if op.op_type == "reduce_scatter":
        rows = source.meta["val"].shape[0] // group
        return _insert(graph, before, torch.ops.aten.slice.Tensor, (source, 0, 0, rows))
    return _insert(graph, before, torch.ops.aten.cat.default, ([source] * group, 0))


class CollectiveFree(CustomGraphPass):
    """The post-grad pass. `removed` / `left`: collectives replaced / still in the graphs it
    saw, summed over every graph compiled with it (a bench reads the change per shape)."""

    def __init__(self):
        self.removed = 0
        self.left = 0
        self.graphs = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs += 1
        for node in list(graph.nodes):
            op = anchors.collective_anchor(node)
            if op is None:
                continue
            wait = op.outputs[0]
            wait.replace_all_uses_with(_stand_in(graph, op, wait))
            for gone in reversed([n for n in graph.nodes if n in op.nodes]):  # users first
                graph.erase_node(gone)
            self.removed += 1
        self.left += sum(anchors.is_collective(n, frozenset()) for n in graph.nodes)
        graph.lint()

    def counts(self) -> dict:
        return {"collectives_removed": self.removed, "collectives_left": self.left,
                "floor_graphs": self.graphs}

    def uuid(self) -> None:
        # None: Inductor bypasses its FX graph cache for these graphs, so the pass runs at every
        # compile and its counts are real (a cache hit would skip it and count nothing).
        return None


def compile_model(model, floor: CollectiveFree, *, mode: str | None = None, **kwargs):
    """torch.compile(model, mode=mode, **kwargs) with `floor` as this compile's post-grad pass
    (mode turned into its options, as infini_dist.compile.compile_model does: torch.compile
    takes mode or options, not both)."""
    from torch._inductor import list_mode_options
    options = dict(list_mode_options(mode, kwargs.get("dynamic"))) if mode else {}
    options[_OPTION] = floor
    return torch.compile(model, backend="inductor", options=options, **kwargs)
