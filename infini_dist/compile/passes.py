"""The post-grad pass: every all_reduce, reduce_scatter and all_gather (and registered user op)
with its chains -> one `infini_dist.fused_site` call.

For each anchor (compile/anchors.py), in one direction:

  1. match: the anchor kind's module grows its site (compile/all_reduce_match.py,
     compile/scatter_gather_match.py; a registered user op's site is compile/matching.py's shared
     walk alone). Each module shows its pattern and replacement side by side.
  2. decide: a graph compiled after its sites decided in this process follows the decisions
     (compile/decided.py): a site decided native is left as it is, one decided bare (our
     collective, nothing else fused) becomes its collective alone.
  3. replace: the site becomes one `fused_site` call reading the site's inputs, named by its
     SubGraph text, unless its kind has nothing of its own for the anchor alone; a site with
     attributes the graph holds as 0-dim CPU tensors is a `fused_site_scalars` call, which
     reads them too (scheduler/run_time_attrs.py).

The engine turns that SubGraph into its choices (fused kernels at each depth, and `native`:
NCCL + the epilogue as Inductor compiles it) and commits the fastest across the group at run
time, native unless a fused choice beats it by `fusion_speedup_threshold`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import math
import operator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import infini_dist
import infini_dist.kernels.epilogue
from infini_dist.compile import all_reduce_match, anchors, capture, chain_match, decided
from infini_dist.compile import fx_patterns, matching
from infini_dist.compile import scatter_gather_match
from infini_dist.compile.block_sum_first import block_sum_first
from infini_dist.compile.reshape_first import reshape_first
from infini_dist.compile import runtime_op  # noqa: F401  (registers infini_dist::fused_site)
from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta, algorithms_for
from infini_dist.scheduler.ir import OpNode, SubGraph, subgraph_from_text
from infini_dist.scheduler.settings import Settings
from infini_dist.scheduler.store import STORE

log = logging.getLogger("infini_dist")

# anchor IR op -> the module that matches its sites; any other (a registered user op): the shared
# walk alone. Each has find_site(index, anchor, settings) and RUNS_ALONE.
_KINDS = {op_type: kind for kind in (all_reduce_match, scatter_gather_match)
          for op_type in kind.OP_TYPES}

# What a graph's record lists as its collectives (bench_torchtitan's table, tests); wait_tensor
# only completes one of them.
_COLLECTIVE_NAMESPACES = ("_c10d_functional.", "symm_mem.")

_UUID_FLAGS = ("enable_custom_op_fusion", "custom_op_fusion_types", "enable_recursive_fusion",
               "max_fusion_depth", "matmul_prologue", "row_split", "backward_sites")


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """Hash of the code that decides what the pass writes into a graph."""
    package = Path(__file__).parent
    scheduler = Path(infini_dist.scheduler.ir.__file__).parent
    h = hashlib.sha256()
    specs = Path(infini_dist.kernels.epilogue.__file__).parent  # the ops' FX spellings
    ours = [scheduler / name for name in ("ir.py", "boundary.py", "op_registry.py",
                                          "split_chain.py")]
    for path in sorted(package.glob("*.py")) + ours + sorted(specs.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def to_subgraph(site: matching.FxSite) -> tuple[SubGraph, list, list, list, list]:
    """The site as a SubGraph with canonical names, its graph inputs, its read outputs, and its
    run-time scalars (fx_patterns.RunTimeScalar) with the `slots` their values go in
    ("node index:attribute"; the SubGraph holds NaN there until they do)."""
    names: dict = {}
    inputs: list = []
    nodes = []
    scalars: list = []
    slots: list = []
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
        attrs = dict(op.attrs)
        for key, value in op.attrs.items():
            if isinstance(value, fx_patterns.RunTimeScalar):
                slots.append(f"{len(nodes)}:{key}")
                scalars.append(value.node)
                attrs[key] = math.nan
        nodes.append(OpNode(op.op_type, tuple(reads), tuple(writes), attrs))
    region = site.nodes
    outputs = [out for op in site.ops for out in op.outputs
               if out is not None and any(u not in region for u in out.users)]
    sub = SubGraph(tuple(nodes), tuple(names[n] for n in inputs), tuple(names[n] for n in outputs))
    return sub, inputs, outputs, scalars, slots


def _replace(graph: fx.Graph, site: matching.FxSite, g: matching.GraphIndex, text: str,
             inputs: list, outputs: list, scalars: list, slots: list) -> None:
    region = site.nodes
    anchor = next(iter(site.anchors[0].nodes - site.anchors[0].projections))
    args = (list(inputs), list(scalars), text, list(slots)) if slots else (list(inputs), text)
    op = torch.ops.infini_dist.fused_site_scalars if slots else torch.ops.infini_dist.fused_site
    with graph.inserting_after(matching.insertion_point(g, site)):
        call = graph.call_function(op.default, args)
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
    """(site, text, inputs, outputs, scalars, slots) to write: `site`, or its collective alone
    where the whole site was decided to fuse nothing (compile/decided.py); text None: decided
    native, leave it to Inductor."""
    forms = [site] if len(site.ops) == 1 else [site, matching.bare_site(site.anchors[0])]
    subs = [to_subgraph(form) for form in forms]
    index, native = decided.written([(sub.canonical(), sub_inputs)
                                     for sub, sub_inputs, *_ in subs], settings)
    site, (sub, inputs, outputs, scalars, slots) = forms[index], subs[index]
    if native:
        log.info("infini_dist: site %s is decided native; left to Inductor",
                 _summary(sub.canonical()))
        return site, None, inputs, outputs, scalars, slots
    return site, sub.canonical(), inputs, outputs, scalars, slots


def fuse_sites(graph: fx.Graph, settings: Settings) -> list[str]:
    """Rewrite every site of `graph` in place; returns the SubGraph text of each. Recorded in
    FUSION_PASS's log like a graph Inductor hands the pass (the infini_dist backend calls this,
    and its graphs count the same)."""
    return FUSION_PASS.rewrite(graph, settings)


def _rewrite(graph: fx.Graph, settings: Settings) -> GraphRecord:
    kind, collectives = _describe(graph)  # before the sites replace the collectives
    if not settings.enable_custom_op_fusion or (kind == "backward"
                                                and not settings.backward_sites):
        return GraphRecord(kind, collectives, ())
    custom = anchors.anchor_names()
    block_sum_first(graph)  # before reshape_first, which then finds a summed block's reshape
    reshape_first(graph)
    # what the sites are matched under: matmul_prologue "auto" made True or False for this graph
    matching_settings = replace(settings,
                                matmul_prologue=capture.matmul_prologue(graph, settings))
    run_time_scalars = not capture.scalars_reach_the_gpu()
    replaced: list[str] = []
    native = 0
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
        if _no_algorithm_of_ours(found):
            skipped.add(node)  # it could only run native: Inductor's own code, no dispatch
            continue
        index = matching.GraphIndex(graph, custom, run_time_scalars)
        kind_module = _KINDS.get(found.op_type, matching)
        site, text, inputs, outputs, scalars, slots = _to_write(
            kind_module.find_site(index, found, matching_settings), settings)
        if (text is not None and len(site.ops) == 1 and not kind_module.RUNS_ALONE
                and not (found.op_type in scatter_gather_match.ALONE_WHERE_OURS
                         and _ours_alone(found, text, inputs, outputs))):
            skipped.add(node)  # nothing of ours could run it: Inductor's own code, no dispatch
            continue
        if text is None:
            skipped.add(node)  # Inductor's own code: no dispatch, no fusion boundary
            native += 1
            continue
        _replace(graph, site, index, text, inputs, outputs, scalars, slots)
        replaced.append(text)
    chains = chain_match.rewrite_chains(graph) if (matching_settings.matmul_prologue
                                                   and settings.row_split) else []
    if replaced:
        graph.lint()
        log.info("infini_dist: %d deferred-choice site(s) in a graph: %s", len(replaced),
                 "; ".join(_summary(t) for t in replaced))
    if chains:
        log.info("infini_dist: %d row-split chain(s) of %s site(s)", len(chains),
                 ", ".join(str(chain_match.length(t)) for t in chains))
    return GraphRecord(kind, collectives, tuple(replaced), native, tuple(chains))


def _no_algorithm_of_ours(anchor: anchors.FxOp) -> bool:
    """On a speed device, no algorithm of ours runs the anchor's op (whatever it fuses)."""
    device = anchors.speed_device(anchor)
    return device is not None and not algorithms_for(anchor.op_type, device.type)


def _ours_alone(anchor: anchors.FxOp, text: str, inputs: list, outputs: list) -> bool:
    """Whether an algorithm of ours runs the anchor's lone site (a small all_gather on a GPU,
    scatter_gather_match.ALONE_WHERE_OURS): then the site competes with Inductor's code; else
    nothing of ours could run it."""
    device = anchors.speed_device(anchor)
    if device is None:
        return False
    sub = subgraph_from_text(text)
    values = [node.meta["val"] for node in inputs + outputs]
    if not all(isinstance(size, int) for value in values for size in value.shape):
        # A dynamic shape: asking for its size would guard on it (a recompile per size). The
        # engine decides per shape at run time, natively where ours declines.
        return bool(algorithms_for(anchor.op_type, device.type))
    meta = {name: TensorMeta.of(value)
            for name, value in zip(sub.input_names + sub.output_names, values)}
    ctx = RunContext(None, anchor.attrs.get("group_size", 1), 0, device)
    span = FusedSpan(sub, (), (0,), ())
    return any(a.supports(span, meta, ctx) for a in algorithms_for(anchor.op_type, device.type))


def _describe(graph: fx.Graph) -> tuple[str, tuple[str, ...]]:
    """(forward or backward, the collectives' short names). AOTAutograd names a backward's
    inputs tangents_*; it is all the graph tells, so an inference graph is a forward."""
    kind = "forward"
    collectives = []
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            kind = "backward"
        target = str(node.target)
        if node.op == "call_function" and target.startswith(_COLLECTIVE_NAMESPACES) \
                and "wait_tensor" not in target:
            collectives.append(target.split(".")[1])
    return kind, tuple(collectives)


def _summary(text: str) -> str:
    sub = subgraph_from_text(text)
    return "+".join(node.op_type for node in sub.nodes)


@dataclass(frozen=True)
class GraphRecord:
    """One graph the pass ran on: "forward" or "backward", the collectives it held before the
    pass ("all_reduce", "reduce_scatter", ...), the SubGraph text of each site written, and how
    many sites were left as Inductor's code, decided native (compile/decided.py), and the
    row-split chains made of its sites."""

    kind: str
    collectives: tuple[str, ...]
    sites: tuple[str, ...]
    native_sites: int = 0
    chains: tuple[str, ...] = ()  # the row-split chains' texts (compile/chain_match.py)

    def site_ops(self) -> list[list[str]]:
        """Each site's IR op types, in order."""
        return [[node.op_type for node in subgraph_from_text(t).nodes] for t in self.sites]


class PassLog:
    """What the pass did in this process: `stats` counts "graphs" seen, "sites" written and
    "native_sites" left to Inductor; `last_sites` is the latest graph's site texts; recording()
    collects the GraphRecord of each graph while open.

    Only graphs the pass runs on count: a graph served from Inductor's FX graph cache skips the
    post-grad passes and adds nothing. Inductor runs them in the process that compiles (its
    compile workers only build kernels), so this log is that process's."""

    def __init__(self):
        self.stats: collections.Counter = collections.Counter()
        self.last_sites: list[str] = []
        self._open: list[list[GraphRecord]] = []

    def add(self, record: GraphRecord) -> None:
        self.stats["graphs"] += 1
        self.stats["sites"] += len(record.sites)
        self.stats["native_sites"] += record.native_sites
        self.stats["chains"] += len(record.chains)
        self.last_sites = list(record.sites)  # a new list: copies taken earlier stay as they were
        for graphs in self._open:
            graphs.append(record)

    @contextlib.contextmanager
    def recording(self):
        """A list that fills with the GraphRecord of each graph the pass runs on until the
        block ends. Nested blocks each get every graph of their own span."""
        graphs: list[GraphRecord] = []
        self._open.append(graphs)
        try:
            yield graphs
        finally:  # by identity: two open lists may be equal (both empty)
            self._open = [g for g in self._open if g is not graphs]


class FusionPass(CustomGraphPass):
    """The Inductor post-grad pass. Its uuid covers the code, the package version and the flags
    it reads, so Inductor's FX graph cache can keep graphs it rewrote."""

    def __init__(self):
        self.log = PassLog()

    def __call__(self, graph: fx.Graph) -> None:
        self.rewrite(graph, infini_dist.config.snapshot())

    def rewrite(self, graph: fx.Graph, settings: Settings) -> list[str]:
        """The pass under `settings`, recorded in this pass's log; the sites' texts."""
        record = _rewrite(graph, settings)
        self.log.add(record)
        return list(record.sites)

    def uuid(self) -> str:
        flags = {name: getattr(infini_dist.config, name) for name in _UUID_FLAGS}
        payload = repr((infini_dist.__version__, _source_hash(), sorted(flags.items()),
                        sorted(anchors.anchor_names()), STORE.digest()))
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self):
        return "infini_dist.compile.FusionPass()"

    # Every copy is the one pass: transformers deep-copies a CompileConfig at each generate()
    # call and compiles again when the copy's options differ from the last ones. What the pass
    # writes depends only on its uuid's inputs, never on its log, and a copy's graphs belong in
    # the one log.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


FUSION_PASS = FusionPass()
