"""The replacement: one torch op that runs a whole site through the engine.

    outputs = torch.ops.infini_dist.fused_site(inputs, graph_json)

`graph_json` is the site's `SubGraph.canonical()` text. It is a plain string argument, so the
compiled code (and Inductor's FX graph cache) carries the site itself, identical on every rank:
no registry has to be filled before a cached graph can run. At run time the engine tunes the site
across its group on the first call per input signature and runs the committed choice after that;
under CUDA-graph capture without a decision it runs natively in eager torch (SiteRunner._decide).
The site's `native` choice is Inductor's own code for it (scheduler/native_inductor.py).
`fused_site_scalars` is the same op for a site with attributes the graph reads at run time (a
norm's eps under dynamic=True: scheduler/run_time_attrs.py).
First calls work on a thread of their own (scheduler/setup_thread.py), so CUDA-graph trees can
warm up and record compiled graphs with these ops from the first call.
"""

from __future__ import annotations

import torch

import infini_dist
from infini_dist.compile.cudagraph_tree_state import settle_failed_warmup
from infini_dist.scheduler import run_time_attrs
from infini_dist.scheduler.choices import resolve_group
from infini_dist.scheduler.engine import site_executor
from infini_dist.scheduler.ir import SubGraph, subgraph_from_text
from infini_dist.scheduler.shapes import shape_env
from infini_dist.scheduler.store import STORE

OP_NAME = "infini_dist::fused_site"


# ---- the op --------------------------------------------------------------------------------------

def _unaliased(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous outputs that share memory with no input and no other output.

    A custom op may not return aliases, and Inductor lays out what follows from the fake
    (contiguous) outputs; a fused choice may hand back views of one packed buffer."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    result = []
    for out in outputs:
        out = out.contiguous()
        if out.numel():
            pointer = out.untyped_storage().data_ptr()
            if pointer in seen:
                out = out.clone()
                pointer = out.untyped_storage().data_ptr()
            seen.add(pointer)
        result.append(out)
    return result


def fused_site(inputs: list[torch.Tensor], graph: str) -> list[torch.Tensor]:
    entry = STORE.entries.get(graph)  # C++: a committed launch for exactly these inputs
    if entry is not None and entry.call is not None:
        out = entry.call(entry.op, resolve_group(entry.group_name, None), 0.0, inputs)
        if out is not None:
            return list(out)
    executor = site_executor(graph, infini_dist.config.snapshot())
    names = executor.graph.input_names
    if len(inputs) != len(names):
        raise ValueError(f"infini_dist.fused_site: the site reads {len(names)} tensors, "
                         f"got {len(inputs)}")
    if entry is None and executor.single_site is not None:
        entry = STORE.entry(graph, executor.single_site.group_name)
    try:
        values = executor.run(dict(zip(names, inputs)), None, entry)
    except BaseException:
        settle_failed_warmup(inputs)  # other compiled models keep working
        raise
    return _unaliased([values[name] for name in executor.graph.output_names], list(inputs))


def fused_site_scalars(inputs: list[torch.Tensor], scalars: list[torch.Tensor], graph: str,
                       slots: list[str]) -> list[torch.Tensor]:
    """fused_site of `graph` with the scalars' values in its slots (scheduler/run_time_attrs.py):
    a site whose attribute the graph reads from a 0-dim CPU tensor."""
    values = tuple(float(s) for s in scalars)  # CPU tensors: no device sync
    text = run_time_attrs.bind(graph, tuple(slots), values)
    if text is not None:
        return fused_site(inputs, text)
    sub = run_time_attrs.substitute(graph, tuple(slots), values)
    return _unaliased(run_time_attrs.run_eagerly(sub, list(inputs)), list(inputs))


def evaluate_shapes(sub: SubGraph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs with the right shapes and dtypes (contiguous), computed without communication."""
    env = shape_env(sub.nodes, dict(zip(sub.input_names, inputs)))
    return [torch.empty_like(env[name], memory_format=torch.contiguous_format)
            for name in sub.output_names]


# A plain torch.library registration, not torch.library.custom_op: custom_op's Python wrappers
# (autograd, ADInplaceOrView, schema checks) cost several times the rest of a call's host path,
# and a training step's forward is host-bound at small token counts. The op only ever runs in
# post-grad graphs, below autograd, so it needs no autograd formula.
_LIBRARY = torch.library.Library("infini_dist", "FRAGMENT")
_LIBRARY.define("fused_site(Tensor[] inputs, str graph) -> Tensor[]")
_LIBRARY.impl("fused_site", fused_site, "CompositeExplicitAutograd")
_LIBRARY.define("fused_site_scalars(Tensor[] inputs, Tensor[] scalars, str graph, str[] slots) "
                "-> Tensor[]")
_LIBRARY.impl("fused_site_scalars", fused_site_scalars, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_LIBRARY)
def _(inputs, graph):
    return evaluate_shapes(subgraph_from_text(graph), list(inputs))


@torch.library.register_fake("infini_dist::fused_site_scalars", lib=_LIBRARY)
def _(inputs, scalars, graph, slots):
    return evaluate_shapes(subgraph_from_text(graph), list(inputs))


def decisions(settings=None) -> list[dict]:
    """What each compiled site that ran decided so far (candidates, times, committed choice),
    under whatever settings it ran with, or only under `settings` (a config snapshot)."""
    rows = []
    for text, ran_with, executor in STORE.site_executors():
        if settings is not None and ran_with != settings:
            continue
        for runner in executor.site_runners():
            if runner.last_decision is not None:
                ops = "+".join(n.op_type for n in executor.graph.nodes)
                rows.append(dict(runner.last_decision, op=ops, subgraph=text))
    return rows
