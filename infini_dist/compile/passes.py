"""The post-grad pass: every all_reduce, reduce_scatter and all_gather (and registered user op)
with its chains -> one `infini_dist.fused_site` call.

For each anchor (compile/anchors.py), in one direction:

  1. match: the anchor kind's module grows its site (compile/all_reduce_match.py,
     compile/scatter_gather_match.py; a registered user op's site is compile/matching.py's shared
     walk alone). Each module shows its pattern and replacement side by side.
  2. decide: a graph compiled after its sites decided in this process follows the decisions
     (compile/decided.py): a site decided native is left as it is, one decided native or fusing
     nothing becomes its collective alone.
  3. replace: the site becomes one `fused_site` call reading the site's inputs, named by its
     SubGraph text, unless its kind has nothing of its own for the anchor alone.

The engine turns that SubGraph into its choices (fused kernels at each depth, and `native`:
NCCL + the epilogue as Inductor compiles it) and commits the fastest across the group at run
time, native unless a fused choice beats it by `fusion_speedup_threshold`.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import operator
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import infini_dist
import infini_dist.kernels.epilogue
from infini_dist.compile import all_reduce_match, anchors, decided, matching
from infini_dist.compile import scatter_gather_match
from infini_dist.compile import runtime_op  # noqa: F401  (registers infini_dist::fused_site)
from infini_dist.scheduler.ir import OpNode, SubGraph, subgraph_from_text
from infini_dist.scheduler.settings import Settings
from infini_dist.scheduler.store import STORE

log = logging.getLogger("infini_dist")

# What the pass did in this process: "graphs" seen, "sites" replaced, "native_sites" left as
# Inductor's code (decided native before the graph compiled: compile/decided.py).
stats: collections.Counter = collections.Counter()
last_sites: list = []  # the SubGraph text of each site the latest call replaced

# anchor IR op -> the module that matches its sites; any other (a registered user op): the shared
# walk alone. Each has find_site(index, anchor, settings) and RUNS_ALONE.
_KINDS = {op_type: kind for kind in (all_reduce_match, scatter_gather_match)
          for op_type in kind.OP_TYPES}

_UUID_FLAGS = ("enable_custom_op_fusion", "custom_op_fusion_types", "enable_recursive_fusion",
               "max_fusion_depth", "matmul_prologue")


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """Hash of the code that decides what the pass writes into a graph."""
    package = Path(__file__).parent
    scheduler = Path(infini_dist.scheduler.ir.__file__).parent
    h = hashlib.sha256()
    specs = Path(infini_dist.kernels.epilogue.__file__).parent  # the ops' FX spellings
    for path in (sorted(package.glob("*.py")) + [scheduler / "ir.py", scheduler / "op_registry.py"]
                 + sorted(specs.glob("*.py"))):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def to_subgraph(site: matching.FxSite) -> tuple[SubGraph, list, list]:
    """The site as a SubGraph with canonical names, its graph inputs and its read outputs."""
    names: dict = {}
    inputs: list = []
    nodes = []
    count = 0
    for op in site.ops:
        reads = []
        for value in op.inputs:
            if value not in names:
                names[value] = f"in{len(inputs)}"
                inputs.append(value)
            reads.append(names[value])
        writes = []
        for out in op.outputs:
            writes.append(f"v{count}")
            if out is not None:
                names[out] = f"v{count}"
            count += 1
        nodes.append(OpNode(op.op_type, tuple(reads), tuple(writes), op.attrs))
    region = site.nodes
    outputs = [out for op in site.ops for out in op.outputs
               if out is not None and any(u not in region for u in out.users)]
    sub = SubGraph(tuple(nodes), tuple(names[n] for n in inputs), tuple(names[n] for n in outputs))
    return sub, inputs, outputs


def _replace(graph: fx.Graph, site: matching.FxSite, g: matching.GraphIndex, text: str,
             inputs: list, outputs: list) -> None:
    region = site.nodes
    anchor = next(iter(site.anchors[0].nodes - site.anchors[0].projections))
    with graph.inserting_after(matching.insertion_point(g, site)):
        call = graph.call_function(torch.ops.infini_dist.fused_site.default, (list(inputs), text))
    call.meta["val"] = _fake_outputs(inputs, text)
    call.meta["stack_trace"] = anchor.meta.get("stack_trace")
    previous = call
    for index, old in enumerate(outputs):
        with graph.inserting_after(previous):
            item = graph.call_function(operator.getitem, (call, index))
        item.meta["val"] = call.meta["val"][index]
        old.replace_all_uses_with(item, delete_user_cb=lambda user: user not in region)
        previous = item
    for node in sorted(region, key=g.order.get, reverse=True):
        graph.erase_node(node)


def _fake_outputs(inputs: list, text: str) -> list:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    values = [n.meta["val"] for n in inputs]
    mode = detect_fake_mode(values)
    if mode is None:  # real example values (a graph traced without fake tensors)
        mode = FakeTensorMode()
        values = [mode.from_tensor(v) for v in values]
    with mode:
        return list(torch.ops.infini_dist.fused_site.default(values, text))


def _to_write(site: matching.FxSite, settings: Settings):
    """(site, text, inputs, outputs) to write: `site`, or its collective alone where the whole
    site was decided to fuse nothing (compile/decided.py); text None: decided native, leave it
    to Inductor."""
    forms = [site] if len(site.ops) == 1 else [site, matching.bare_site(site.anchors[0])]
    subs = [to_subgraph(form) for form in forms]
    index, native = decided.written([(sub.canonical(), inputs) for sub, inputs, _ in subs],
                                    settings)
    site, (sub, inputs, outputs) = forms[index], subs[index]
    if native:
        log.info("infini_dist: site %s is decided native; left to Inductor",
                 _summary(sub.canonical()))
        return site, None, inputs, outputs
    return site, sub.canonical(), inputs, outputs


def fuse_sites(graph: fx.Graph, settings: Settings) -> list[str]:
    """Rewrite every site of `graph` in place; returns the SubGraph text of each."""
    stats["graphs"] += 1
    last_sites.clear()
    if not settings.enable_custom_op_fusion:
        return []
    custom = anchors.anchor_names()
    replaced: list[str] = []
    skipped: set = set()
    while True:
        found = None
        for node in graph.nodes:
            if node in skipped or node.op != "call_function":
                continue
            found = anchors.collective_anchor(node) or anchors.custom_anchor(node, custom)
            if found is not None:
                break
            if node.target in anchors.COLLECTIVES:
                skipped.add(node)  # not a sum, or its result is used without a wait
        if found is None:
            break
        index = matching.GraphIndex(graph, custom)
        kind = _KINDS.get(found.op_type, matching)
        site, text, inputs, outputs = _to_write(kind.find_site(index, found, settings), settings)
        if text is not None and len(site.ops) == 1 and not kind.RUNS_ALONE:
            skipped.add(node)  # nothing of ours could run it: Inductor's own code, no dispatch
            continue
        if text is None:
            skipped.add(node)  # Inductor's own code: no dispatch, no fusion boundary
            stats["native_sites"] += 1
            continue
        _replace(graph, site, index, text, inputs, outputs)
        replaced.append(text)
    if replaced:
        graph.lint()
        stats["sites"] += len(replaced)
        log.info("infini_dist: %d deferred-choice site(s) in a graph: %s", len(replaced),
                 "; ".join(_summary(t) for t in replaced))
    last_sites[:] = replaced
    return replaced


def _summary(text: str) -> str:
    sub = subgraph_from_text(text)
    return "+".join(node.op_type for node in sub.nodes)


class FusionPass(CustomGraphPass):
    """The Inductor post-grad pass. Its uuid covers the code, the package version and the flags
    it reads, so Inductor's FX graph cache can keep graphs it rewrote."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_sites(graph, infini_dist.config.snapshot())

    def uuid(self) -> str:
        flags = {name: getattr(infini_dist.config, name) for name in _UUID_FLAGS}
        payload = repr((infini_dist.__version__, _source_hash(), sorted(flags.items()),
                        sorted(anchors.anchor_names()), STORE.digest()))
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self):
        return "infini_dist.compile.FusionPass()"

    # Stateless, so every copy is the one pass: transformers deep-copies a CompileConfig at each
    # generate() call and compiles again when the copy's options differ from the last ones.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


FUSION_PASS = FusionPass()
