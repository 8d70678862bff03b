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
