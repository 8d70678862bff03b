"""An all_reduce's result reshaped on its way to the epilogue: the reshape moves ahead of the
all_reduce, so that the epilogue's ops read the all_reduce directly and join its site.

Pattern (post-grad FX, before the sites are matched; each value read by the next node alone):

    w = wait_tensor(all_reduce(p))                     # p: [tokens, H]
    e = <pointwise ops of w and of tensors of w's shape>     # none or more
    v = view(e, [b, s, H])                             # the row length H kept

Replacement:

    w = wait_tensor(all_reduce(reshape(p, [b, s, H])))
    e = <the same ops, their other tensors reshaped the same way>   # v's readers read e

A sum across ranks is elementwise, and so are the ops in between, so both give the same values.
MoE blocks are written this way: transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 flatten the
tokens for their experts, all_reduce the [tokens, H] sum and restore [b, s, H] before the
residual add; Qwen2-MoE adds its shared expert's output (computed whole on every rank) first.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._prims_common import is_contiguous_or_false
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from infini_dist.compile.anchors import collective_anchor, is_tensor, value_of
from infini_dist.compile.matmul_match import _VIEWS, _same, _shape

_RESHAPE = torch.ops.aten.reshape.default


def _viewable(node) -> bool:
    """A contiguous tensor: reshaped, it is a view (a copy would add a pass over memory)."""
    return is_tensor(node) and is_contiguous_or_false(value_of(node))


def _pointwise(node: fx.Node, shape: tuple) -> bool:
    """A pointwise op whose result and every tensor it reads have `shape` (no broadcast), read
    contiguous (a reshape of each is a view)."""
    target = node.target
    if not (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags and is_tensor(node)
            and _same(_shape(node), shape)):
        return False
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    return all(_viewable(a) and _same(_shape(a), shape) for a in operands)


def _path(wait: fx.Node) -> tuple[list, fx.Node] | None:
    """(the pointwise ops, the view) from an all_reduce's `wait` to a view that keeps its row
    length, or None."""
    shape, ops, value = _shape(wait), [], wait
    while len(value.users) == 1:
        user = next(iter(value.users))
        if (user.op == "call_function" and user.target in _VIEWS and is_tensor(user)
                and len(user.args) == 2 and not user.kwargs):
            viewed = _shape(user)
            keeps_rows = len(shape) > 0 and len(viewed) > 0 and _same(viewed[-1:], shape[-1:])
            return (ops, user) if keeps_rows and user.args[0] is value else None
        if not _pointwise(user, shape):
            return None
        ops.append(user)
        value = user
    return None


def _set_value(node: fx.Node, value) -> None:
    node.meta["val"] = value
    if "tensor_meta" in node.meta:
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)


def _reshaped(graph: fx.Graph, before: fx.Node, value: fx.Node, view: fx.Node) -> fx.Node:
    with graph.inserting_before(before):
        node = graph.call_function(_RESHAPE, (value, view.args[1]))
    _set_value(node, value_of(value).reshape(value_of(view).shape))
    return node


def reshape_first(graph: fx.Graph) -> int:
    """Rewrite every match of the pattern above in place; returns how many."""
    moved = 0
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        anchor = collective_anchor(node)
        if anchor is None or anchor.op_type != "all_reduce":
            continue
        found = _path(anchor.outputs[0]) if _viewable(node.args[0]) else None
        if found is None:
            continue
        ops, view = found
        shape = view.args[1]
        sizes = [n for n in (shape if isinstance(shape, (list, tuple)) else [shape])
                 if isinstance(n, fx.Node)]
        if any(position[n] > position[node] for n in sizes):
            continue  # a size computed after the all_reduce: the reshape cannot go before it
        shaped = value_of(view).shape
        node.args = (_reshaped(graph, node, node.args[0], view), *node.args[1:])
        for step in anchor.nodes:  # the collective and its waits
            _set_value(step, value_of(step).reshape(shaped))
        previous = anchor.outputs[0]
        for step in ops:  # each reads `previous` and tensors of its old shape, reshaped here
            step.args, step.kwargs = fx.node.map_arg(
                (step.args, step.kwargs),
                lambda a, step=step, previous=previous:
                    a if a is previous else _reshaped(graph, step, a, view))
            _set_value(step, value_of(step).reshape(shaped))
            previous = step
        view.replace_all_uses_with(previous)
        graph.erase_node(view)
        moved += 1
    return moved
