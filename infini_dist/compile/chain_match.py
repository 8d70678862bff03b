"""Row-split chains (config.matmul_prologue): consecutive prefill sites whose residual stream
runs from one to the next become one chain the engine runs either site by site or with each
all-reduce split under the GEMMs beside it (scheduler/split_chain.py).

Pattern (after the site pass; each site a matmul-prologue site):

    s_k = fused_site([x_k, w_k, r_k, g_k], '<matmul -> all_reduce -> add_rms_norm>')
    h_k = s_k[0];  r_{k+1} = s_k[1]                 # the norm's output, the new residual
    q = mm(view(h_k, [rows, H]), permute(wq)) ...   # every reader of h_k a GEMM (+ bias)
    x_{k+1} = <attention or MLP of q, ...>          # computed from those GEMMs
    s_{k+1} = fused_site([x_{k+1}, w_{k+1}, r_{k+1}, g_{k+1}], ...)
    ...
    s_n = fused_site(...);  h_n = s_n[0]            # the last: its residual read by nothing,
                                                    # h_n read by anything

Replacement, site by site (h and the residual keep their getitems):

    s_k = split_site([x_k, w_k, r_k, g_k], chain, k)
    q, k_, v = split_read([h_k, wq, wk, wv], chain, k)      # the GEMMs' [rows, N] outputs
    h_n' = split_read([h_n], chain, n)[0]                  # the last, unless GEMMs read it

Only where every residual but the last is read by the next site alone, every norm output but
the last by GEMMs alone, each site's input is computed from the previous site's readers (so
the ops run in chain order), the sizes are static, and the rows are at least MIN_ROWS: the
row parts cost 22.5% of the GEMMs at 512 rows on 2×H100 (docs/notes_symm.md, session 31), so
smaller prefills and every decode keep their sites as they are.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
import torch.fx as fx

from infini_dist.compile import split_op  # noqa: F401  (registers the ops)
from infini_dist.compile.anchors import is_tensor, value_of
from infini_dist.compile.matmul_match import _VIEWS, _gemm, _is_transpose
from infini_dist.scheduler.ir import subgraph_from_text
from infini_dist.scheduler.split_chain import ChainSite, chain_text, parse_chain

log = logging.getLogger("infini_dist")

FUSED = torch.ops.infini_dist.fused_site.default
SPLIT_SITE = torch.ops.infini_dist.split_site.default
SPLIT_READ = torch.ops.infini_dist.split_read.default
MIN_ROWS = 1024
_SHAPE = ("matmul", "all_reduce", "add_rms_norm")
_WALK = 4096  # nodes walked back from a site's input to the previous site's readers


def _static(node) -> tuple | None:
    value = value_of(node) if is_tensor(node) else None
    if value is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _outputs(node: fx.Node) -> dict | None:
    """{index: getitem} of a site's outputs, None if something else reads it."""
    items = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        items[user.args[1]] = user
    return items


def _readers(h: fx.Node, rows: int, hidden: int) -> list | None:
    """[(gemm, weight, transpose, bias)] reading h, None unless every reader is such a GEMM."""
    found = []
    for user in h.users:
        views = [user] if user.op == "call_function" and user.target in _VIEWS else []
        gemms = [u for v in views for u in v.users] if views else [user]
        if views and _static(user) != (rows, hidden):
            return None
        for node in gemms:
            parts = _gemm(node) if node.op == "call_function" else None
            if parts is None or parts[0] is not (views[0] if views else h):
                return None
            _, b, bias = parts
            weight, transpose = (b.args[0], True) if (b.op == "call_function"
                                                      and _is_transpose(b)) else (b, False)
            dtype = value_of(h).dtype  # the split's outputs are made in h's dtype
            if not (is_tensor(weight) and value_of(weight).dim() == 2
                    and value_of(weight).dtype == dtype == value_of(node).dtype
                    and (bias is None or (is_tensor(bias) and value_of(bias).dim() == 1
                                          and value_of(bias).dtype == dtype))):
                return None
            found.append((node, weight, transpose, bias))
    return found


def _site(node: fx.Node) -> tuple | None:
    """(ChainSite without its readers, the site's inputs, its getitems) of a matmul-prologue
    site, else None."""
    if node.op != "call_function" or node.target is not FUSED:
        return None
    inputs, text = node.args
    sub = subgraph_from_text(text)
    items = _outputs(node)
    if ([n.op_type for n in sub.nodes] != list(_SHAPE) or len(inputs) != 4 or items is None
            or sub.output_names not in (("v2", "v3"), ("v2",)) or 0 not in items
            or sub.nodes[1].attr("op") != "sum" or len(sub.nodes[0].inputs) != 2):
        return None
    x, _, residual, _ = (_static(n) for n in inputs)
    if x is None or residual is None:
        return None
    count, hidden = math.prod(residual[:-1]), residual[-1]
    if math.prod(x[:-1]) != count:
        return None
    matmul, norm = sub.nodes[0], sub.nodes[2]
    spec = ChainSite(text, count, x[-1], hidden, bool(matmul.attr("transpose_weight")),
                     float(norm.attr("eps")), 1 in items and bool(items[1].users), ())
    return spec, list(inputs), items, sub.nodes[1].attr("group_name")


def _reaches(start, targets: set) -> bool:
    """Whether `start` is computed from any of `targets` (a bounded walk back)."""
    seen, stack = set(), [start]
    while stack and len(seen) < _WALK:
        node = stack.pop()
        if node in targets:
            return True
        if isinstance(node, fx.Node) and node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return False


def _grow(node: fx.Node) -> tuple[list, str | None]:
    """(the chain starting at `node`, why it ends short: None where it is a whole chain)."""
    chain, current = [], node
    while True:
        found = _site(current)
        if found is None:
            return chain, f"{current.name} is no matmul-prologue site of static shapes"
        spec, inputs, items, group = found
        readers = _readers(items[0], spec.rows, spec.hidden)
        chain.append([spec, inputs, items, readers, group, current])
        if not spec.residual_out:  # the chain's end
            return chain, None if items[0].users else f"nothing reads {current.name}'s norm"
        nexts = list(items[1].users)
        if not readers:
            return chain, f"{current.name}'s norm is read by more than GEMMs"
        if len(nexts) != 1:
            return chain, f"{current.name}'s residual is read {len(nexts)} times"
        current = nexts[0]
        if not (current.target is FUSED and current.args[0][2] is items[1]):
            return chain, f"{current.name} is no site adding {node.name}'s residual"
        if not _reaches(current.args[0][0], {r[0] for r in readers}):
            return chain, f"{current.name}'s input is not computed from the GEMMs before it"


def find_chains(graph: fx.Graph) -> list[list]:
    """The graph's chains: per site [spec, inputs, getitems, readers, group, node], in order."""
    chains, taken = [], set()
    for node in graph.nodes:
        if node in taken or _site(node) is None:
            continue
        chain, short = _grow(node)
        if short is None and len(chain) >= 2 and len({c[4] for c in chain}) == 1 \
                and len({value_of(c[1][2]).dtype for c in chain}) == 1 \
                and all(c[0].rows >= MIN_ROWS for c in chain):
            chains.append(chain)
            taken.update(c[5] for c in chain)
        elif len(chain) >= 2 or short:
            log.debug("infini_dist: no row-split chain from %s: %s", node.name,
                      short or "its sites' rows, groups or dtypes")
    return chains


def rewrite_chains(graph: fx.Graph) -> list[str]:
    """Rewrite every chain of `graph` in place; the chains' texts."""
    texts = []
    for chain in find_chains(graph):
        sites = []
        for spec, _, _, readers, _, _ in chain:
            described = () if readers is None else tuple(
                ((value_of(w).shape[0] if t else value_of(w).shape[1]), t, bias is not None)
                for _, w, t, bias in readers)
            sites.append(dataclasses.replace(spec, readers=described))
        text = chain_text(chain[0][4], value_of(chain[0][1][2]).dtype, sites)
        for index, (_, inputs, items, readers, _, node) in enumerate(chain):
            node.target, node.args = SPLIT_SITE, (inputs, text, index)
            _write_read(graph, items[0], readers, text, index)
        texts.append(text)
    if texts:
        graph.eliminate_dead_code()
        graph.lint()
    return texts


def _write_read(graph: fx.Graph, h: fx.Node, readers, text: str, index: int) -> None:
    if not readers:  # the last site, read by anything: a copy of every row
        with graph.inserting_after(h):
            read = graph.call_function(SPLIT_READ, ([h], text, index))
        with graph.inserting_after(read):
            item = graph.call_function(operator.getitem, (read, 0))
        read.meta["val"] = [h.meta["val"].clone()]
        item.meta["val"] = read.meta["val"][0]
        h.replace_all_uses_with(item, delete_user_cb=lambda user: user is not read)
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((r[0] for r in readers), key=order.get)
    operands = [h]
    for _, weight, _, bias in readers:
        operands += [weight] + ([bias] if bias is not None else [])
    if any(order[o] > order[first] for o in operands):
        raise AssertionError("infini_dist: a row-split reader's weight comes after its GEMM")
    with graph.inserting_before(first):
        read = graph.call_function(SPLIT_READ, (operands, text, index))
        read.meta["val"] = [r[0].meta["val"] for r in readers]
        for i, (gemm, _, _, _) in enumerate(readers):
            item = graph.call_function(operator.getitem, (read, i))
            item.meta["val"] = gemm.meta["val"]
            gemm.replace_all_uses_with(item)


def length(text: str) -> int:
    """How many sites chain `text` has."""
    return len(parse_chain(text)[2])
