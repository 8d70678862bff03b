"""The matmul that produces an all_reduce's input, as the IR op `matmul` (config.matmul_prologue):
compile/all_reduce_match.py makes it the head of the all_reduce's prologue chain.

One matcher for every spelling a row-parallel projection takes in a post-grad graph (vLLM
matches its GEMM + all_reduce fusion the same way, over the aten ops rather than traced forms):

    torch.mm(x, w)              mm(x, w)
    F.linear(x, w)  (x 2-D)     mm(x, permute(w, [1, 0]))
    F.linear(x, w, b)           addmm(b, x, permute(w, [1, 0]))
    F.linear(x, w[, b]) (x N-D) view(mm|addmm([b,] view(x, [rows, K]), permute(w)), [..., N])

becomes matmul(x, w[, b], transpose_weight=<w was permuted>): x [..., K] -> [..., N], the
model's own layouts kept (no weight is copied or transposed). The views and the permute are
taken in only where nothing else reads them; a permuted weight that something else reads too
(a training graph's backward) stays a graph value, and the IR op reads it untransposed.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from infini_dist.compile.anchors import FxOp, is_tensor, value_of

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_TRANSPOSES = (aten.permute.default, aten.t.default)


def _private(node, users: frozenset) -> bool:
    """`node` is a call whose every reader is in `users`."""
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and all(u in users for u in node.users))


def _shape(node) -> tuple:
    return tuple(value_of(node).shape)


def _same(a: tuple, b: tuple) -> bool:
    """Equal shapes, symbolic sizes included, without adding a guard to the graph."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _is_transpose(node) -> bool:
    if node.target is aten.t.default:
        return True
    return node.target is aten.permute.default and list(node.args[1]) == [1, 0]


def _unit(value) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def _gemm(node):
    """(x2d, b, bias) of an mm or a plain addmm (beta = alpha = 1), else None."""
    if node.target is aten.mm.default and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1], None
    if node.target is aten.addmm.default and len(node.args) == 3 and set(node.kwargs) <= {
            "beta", "alpha"} and all(_unit(node.kwargs.get(k)) for k in ("beta", "alpha")):
        return node.args[1], node.args[2], node.args[0]
    return None


def matmul_producer(value, consumers: frozenset) -> FxOp | None:
    """The matmul whose result is `value`, read only by `consumers` (the anchor's nodes), as
    an IR op; None where `value` is no such matmul."""
    if not _private(value, consumers) or not is_tensor(value):
        return None
    out_view, gemm = None, value
    if value.target in _VIEWS and isinstance(value.args[0], fx.Node):
        out_view, gemm = value, value.args[0]
        if not _private(gemm, frozenset([out_view])):
            return None
    found = _gemm(gemm) if isinstance(gemm, fx.Node) and gemm.op == "call_function" else None
    if found is None:
        return None
    rows, b, bias = found
    if not all(is_tensor(n) for n in (rows, b)) or (bias is not None and not is_tensor(bias)):
        return None
    nodes = {gemm} | ({out_view} if out_view is not None else set())
    x = rows
    if out_view is not None:  # x [..., K] flattened to [rows, K] on the way in
        if not (_private(rows, frozenset([gemm])) and rows.target in _VIEWS
                and isinstance(rows.args[0], fx.Node) and is_tensor(rows.args[0])):
            return None
        x = rows.args[0]
        k, n = _shape(rows)[-1], _shape(gemm)[-1]
        if not (_same(_shape(x)[-1:], (k,)) and _same(_shape(value), _shape(x)[:-1] + (n,))
                and _same(_shape(rows)[:1], (math.prod(_shape(x)[:-1]),))):
            return None
        nodes.add(rows)
    w, transpose = b, False
    if _private(b, frozenset([gemm])) and _is_transpose(b) and isinstance(b.args[0], fx.Node) \
            and is_tensor(b.args[0]):
        w, transpose = b.args[0], True
        nodes.add(b)
    dtype = value_of(x).dtype
    tensors = [x, w] + ([bias] if bias is not None else [])
    if (not dtype.is_floating_point or value_of(value).dtype != dtype
            or any(value_of(t).dtype != dtype for t in tensors) or value_of(w).dim() != 2
            or (bias is not None and not _same(_shape(bias), _shape(value)[-1:]))):
        return None  # a bias over rows too (addmm's broadcast) is no linear's bias
    return FxOp("matmul", tensors, [value], {"transpose_weight": transpose}, frozenset(nodes))


# ---- beside an all_reduce: the weight gradients of the GEMMs that made its input -----------------
#
# In a backward graph a column-parallel linear's input gradient is a partial sum that the
# all_reduce completes, and the same linear's weight gradient reads the same output gradient:
#
#     G = view(grad_out, [rows, N])
#     dx = mm(G, W)                       (or several such GEMMs added: q, k and v apart)
#     all_reduce(view(dx))                <- the anchor
#     dw = mm(permute(G, [1, 0]), x)      (Inductor may place it before or after dx)
#
# becomes weight_gradient(G, x) -> dw, beside the site, so that a choice may run the GEMM while
# the collective is in flight (fusion type "overlap"). Only GEMMs whose every reader comes after
# the site: the site is one op at its last node, and nothing in it may need them.

_WALK = 16  # nodes walked back from the all_reduce's input to the GEMMs that make it


def _gradient_operands(value) -> list:
    """The left operands of the mm / addmm nodes whose sum (through views and adds) is
    `value`."""
    found, stack, steps = [], [value], 0
    while stack and steps < _WALK:
        node = stack.pop()
        steps += 1
        if not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        if node.target in _VIEWS:
            stack.append(node.args[0])
        elif node.target is aten.add.Tensor and not node.kwargs:
            stack.extend(node.args[:2])
        elif (gemm := _gemm(node)) is not None:
            found.append(gemm[0])
    return found


def _aliases(grad) -> list:
    """`grad` and the other views of its source with its shape (the same rows, spelled twice
    where the graph was not deduplicated)."""
    if not (grad.op == "call_function" and grad.target in _VIEWS
            and isinstance(grad.args[0], fx.Node)):
        return [grad]
    return [grad] + [v for v in grad.args[0].users if v is not grad and v.op == "call_function"
                     and v.target in _VIEWS and is_tensor(v) and _same(_shape(v), _shape(grad))]


def weight_gradients(order: dict, value, after: fx.Node, taken: frozenset) -> list:
    """weight_gradient FxOps for the GEMMs beside the all_reduce of `value` (the comment above),
    in graph order; `after`: the node the site will be placed at, `order`: graph positions."""
    ops = []
    operands = [a for g in _gradient_operands(value) if isinstance(g, fx.Node) for a in _aliases(g)]
    for grad in dict.fromkeys(operands):
        if not is_tensor(grad) or value_of(grad).dim() != 2:
            continue
        for transpose in grad.users:
            if not (transpose.op == "call_function" and _is_transpose(transpose)):
                continue
            for gemm in transpose.users:
                if (gemm in taken or gemm.target is not aten.mm.default or gemm.kwargs
                        or gemm.args[0] is not transpose):
                    continue
                x = gemm.args[1]
                if not (is_tensor(x) and is_tensor(gemm) and value_of(x).dim() == 2
                        and _same(_shape(x)[:1], _shape(grad)[:1])
                        and value_of(x).dtype == value_of(grad).dtype == value_of(gemm).dtype
                        and value_of(x).dtype.is_floating_point
                        and order[x] < order[after]
                        and all(order[u] > order[after] for u in gemm.users)):
                    continue
                nodes = {gemm} | ({transpose} if _private(transpose, frozenset([gemm])) else set())
                ops.append(FxOp("weight_gradient", [grad, x], [gemm], {}, frozenset(nodes)))
    return sorted(ops, key=lambda op: order[next(iter(op.outputs))])
