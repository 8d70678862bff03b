"""The replacement: one torch op that runs a whole site through the engine.

    outputs = torch.ops.infini_dist.fused_site(inputs, graph_json)

`graph_json` is the site's `SubGraph.canonical()` text. It is a plain string argument, so the
compiled code (and Inductor's FX graph cache) carries the site itself, identical on every rank:
no registry has to be filled before a cached graph can run. At run time the engine tunes the site
across its group on the first call per input signature and runs the committed choice after that;
under CUDA-graph capture without a decision it runs natively in eager torch (SiteRunner._decide).
The site's `native` choice is Inductor's own code for it (scheduler/native_inductor.py).
First calls work on a thread of their own (scheduler/setup_thread.py), so CUDA-graph trees can
warm up and record compiled graphs with these ops from the first call.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

import infini_dist
from infini_dist import ops_express
from infini_dist.compile.cudagraph_tree_state import settle_failed_warmup
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.choices import resolve_group
from infini_dist.scheduler.engine import executor_for
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.shapes import shape_env

OP_NAME = "infini_dist::fused_site"


# ---- the SubGraph <-> text round trip ------------------------------------------------------------

def _attr_value(value: Any) -> Any:
    # Inverse of ir._canonical_value: floats travel as {"float": repr}, tuples as lists.
    if isinstance(value, dict):
        if set(value) != {"float"}:
            raise ValueError(f"unexpected attribute encoding {value!r}")
        return float(value["float"])
    if isinstance(value, list):
        return tuple(_attr_value(v) for v in value)
    return value


@functools.lru_cache(maxsize=4096)
def subgraph_from_json(text: str) -> SubGraph:
    """The SubGraph whose `canonical()` is `text` (validated again on construction)."""
    try:
        data = json.loads(text)
        nodes = tuple(OpNode(op, tuple(inputs), tuple(outputs),
                             {key: _attr_value(value) for key, value in attrs})
                      for op, inputs, outputs, attrs in data["nodes"])
        graph = SubGraph(nodes, tuple(data["inputs"]), tuple(data["outputs"]))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"infini_dist.fused_site: not a canonical SubGraph ({error}): "
                         f"{text[:200]!r}") from None
    if graph.canonical() != text:
        raise ValueError(f"infini_dist.fused_site: graph text is not in canonical form: "
                         f"{text[:200]!r}")
    return graph


# ---- the op --------------------------------------------------------------------------------------

_EXECUTORS: dict = {}  # (text, settings, registry generation) -> executor: no parse per call


def _executor(text: str):
    key = (text, infini_dist.config.snapshot(), op_registry.generation())  # re-registered: anew
    executor = _EXECUTORS.get(key)
    if executor is None:
        executor = _EXECUTORS[key] = executor_for(subgraph_from_json(text), key[1],
                                                  compiled=True)
    return executor


def known_executor(text: str, settings):
    """The executor of site `text` under `settings` if one ran in this process, else None."""
    return _EXECUTORS.get((text, settings, op_registry.generation()))


def known_executors() -> list:
    """(site text, executor) for every compiled site that ran in this process."""
    return [(key[0], executor) for key, executor in list(_EXECUTORS.items())]


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
    call = ops_express.call  # C++: a committed launch for exactly these inputs, else None
    if call is not None:
        known = ops_express.site(graph)
        if known is not None:
            out = call(known[0], resolve_group(known[1], None), 0.0, inputs)
            if out is not None:
                return list(out)
    executor = _executor(graph)
    names = executor.graph.input_names
    if len(inputs) != len(names):
        raise ValueError(f"infini_dist.fused_site: the site reads {len(names)} tensors, "
                         f"got {len(inputs)}")
    try:
        values = executor.run(dict(zip(names, inputs)), None)
    except BaseException:
        settle_failed_warmup(inputs)  # other compiled models keep working
        raise
    ops_express.offer(None, executor, dict(zip(names, inputs)), executor.graph.output_names,
                      None, 0.0, site_text=graph)
    return _unaliased([values[name] for name in executor.graph.output_names], list(inputs))


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


@torch.library.register_fake(OP_NAME, lib=_LIBRARY)
def _(inputs, graph):
    return evaluate_shapes(subgraph_from_json(graph), list(inputs))


def decisions(settings=None) -> list[dict]:
    """What each compiled site that ran decided so far (candidates, times, committed choice),
    under whatever settings it ran with, or only under `settings` (a config snapshot)."""
    rows = []
    for (text, ran_with, _), executor in list(_EXECUTORS.items()):
        if settings is not None and ran_with != settings:
            continue
        for runner in executor.site_runners():
            if runner.last_decision is not None:
                ops = "+".join(n.op_type for n in executor.graph.nodes)
                rows.append(dict(runner.last_decision, op=ops, subgraph=text))
    return rows
