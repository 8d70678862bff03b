"""An all_reduce whose result is summed over some of its dims: the sum moves ahead of the
all_reduce, which then sends the summed bytes instead of all of them.

Pattern (post-grad FX, before the sites are matched; each value read by the next node alone):

    w = wait_tensor(all_reduce(p))          # p: [E * T, H]
    v = view(w, [E, T, H])                  # or no view
    s = sum(v, [0])                         # [T, H]; any dims, s keeps w's dtype

Replacement:

    s = wait_tensor(all_reduce(sum(view(p, [E, T, H]), [0])))

Both are sums of the same products: the all_reduce adds the ranks' values elementwise, and the
sum adds elements, so the order of the two does not change the exact result. In floating point
the roundings differ: before, the all_reduce rounded each block's sum over the ranks and torch
then summed the blocks in fp32, rounding once; after, torch sums the blocks in fp32 and rounds
once, and the all_reduce rounds the sum over the ranks. Each way rounds twice in a half type,
as NCCL's ring and tree algorithms round in orders of their own
(tests/test_compile_block_sum_first.py checks both against fp64: in bf16 on two ranks the moved
sum was the closer, 2.4e-3 against 6.6e-3).

transformers' Llama 4 writes its MoE this way: every token goes through every expert, scaled
by its router score, the experts' outputs are all_reduced as [E * T, H] under its TP plan, and
then summed over the E experts. With 16 experts (Llama 4 Scout) the all_reduce carries 16 times
the bytes it needs. After the move the block's all_reduce is [T, H], like its shared expert's,
and the residual add and the next norm join their site (compile/reshape_first.py, then the
engine's sum-first choice sends one all_reduce for both).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from infini_dist.compile.anchors import collective_anchor, is_tensor, value_of
from infini_dist.compile.matmul_match import _VIEWS
from infini_dist.compile.reshape_first import _reshaped, _set_value, _viewable

_SUM = torch.ops.aten.sum.dim_IntList


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _block_sum(wait: fx.Node) -> tuple[fx.Node | None, fx.Node] | None:
    """(the view, the sum) of the pattern after an all_reduce's `wait`, or None. Any sum over
    dims of any view of the result commutes with the all_reduce (both are sums); it has to keep
    the dtype, so that the all_reduce carries the dtype it did."""
    view, reader = None, _only_user(wait)
    if (reader is not None and reader.op == "call_function" and reader.target in _VIEWS
            and len(reader.args) == 2 and not reader.kwargs and is_tensor(reader)):
        view, reader = reader, _only_user(reader)
    if (reader is None or reader.op != "call_function" or reader.target is not _SUM
            or reader.args[0] is not (view if view is not None else wait)
            or reader.kwargs.get("dtype") is not None or not is_tensor(reader)
            or value_of(reader).dtype != value_of(wait).dtype):
        return None
    return view, reader


def block_sum_first(graph: fx.Graph) -> int:
    """Rewrite every match of the pattern above in place; returns how many."""
    moved = 0
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        anchor = collective_anchor(node)
        if anchor is None or anchor.op_type != "all_reduce" or len(anchor.inputs) != 1:
            continue
        found = _block_sum(anchor.outputs[0]) if _viewable(node.args[0]) else None
        if found is None:
            continue
        view, total = found
        shape = view.args[1] if view is not None else []
        sizes = [n for n in (shape if isinstance(shape, (list, tuple)) else [shape])
                 if isinstance(n, fx.Node)]
        if any(position[n] > position[node] for n in sizes):
            continue  # a size computed after the all_reduce: the view cannot go before it
        partial = node.args[0]
        if view is not None:
            partial = _reshaped(graph, node, partial, view)
        with graph.inserting_before(node):
            summed = graph.call_function(_SUM, (partial, *total.args[1:]), dict(total.kwargs))
        _set_value(summed, value_of(total))
        node.args = (summed, *node.args[1:])
        for step in anchor.nodes:  # the collective and its waits
            _set_value(step, value_of(total))
        total.replace_all_uses_with(anchor.outputs[0])
        graph.erase_node(total)
        if view is not None:
            graph.erase_node(view)
        moved += 1
    return moved
