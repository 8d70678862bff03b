"""torch.compile integration: all_reduce -> epilogue chains become deferred-choice sites.

    infini_dist.compile.enable()                  # every torch.compile from here on
    torch.compile(model, options=infini_dist.compile.inductor_options())   # one model
    infini_dist.compile.compile_model(model)      # the same, mode= and options= welcome
    torch.compile(model, backend="infini_dist")   # the pass without Inductor

The pass (`passes.FusionPass`) runs after Inductor's own post-grad passes and replaces each
all_reduce (or registered user op, matched by its 'ns::op' name) and the ops around it with one
`infini_dist::fused_site` call that the engine tunes at run time. Flags it obeys, read when a
graph is compiled: `enable_custom_op_fusion` (off: graphs untouched), `custom_op_fusion_types`
('prologue', 'epilogue', 'cross_subgraph'), `max_fusion_depth` (IR ops captured per chain),
`matmul_prologue` (the mm / addmm / linear feeding an all_reduce joins its site; "auto", the
default: only in graphs Inductor captures in CUDA graphs on CUDA tensors), `row_split` (with
matmul_prologue, prefill sites join into row-split chains: compile/chain_match.py),
`backward_sites` (off: backward graphs' collectives stay Inductor's). They are part of the
pass's uuid, so Inductor's FX graph cache keeps graphs apart by them; Dynamo does not
know them, so call torch._dynamo.reset() after changing them in a running process.
`decisions()` lists what the compiled sites committed, `chain_decisions()` what each row-split
chain committed. What the pass did: `stats` ("graphs", "sites", "native_sites", "chains" in this
process), `last_sites` (the latest graph's site texts), and

    with infini_dist.compile.recording() as graphs:   # a GraphRecord per graph the pass runs on
        model(x).sum().backward()                      # graphs[i].kind, .collectives, .sites
"""

from __future__ import annotations

import functools
import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from infini_dist.compile import runtime_op  # noqa: F401  (registers infini_dist::fused_site)
from infini_dist.compile.backend import BACKEND_NAME, register as _register_backend
from infini_dist.compile.passes import FUSION_PASS, FusionPass, GraphRecord, fuse_sites
from infini_dist.compile.recompile import recompiles, recompiling
from infini_dist.compile.runtime_op import decisions
from infini_dist.scheduler.split_chain import chain_decisions

__all__ = ["enable", "disable", "inductor_options", "compile_model", "FusionPass", "fuse_sites",
           "decisions", "chain_decisions", "recording", "GraphRecord", "stats", "last_sites",
           "recompiles",
           "BACKEND_NAME"]

_register_backend()


def recording():
    """Context manager: a list that fills with the GraphRecord of each graph the pass runs on
    (Inductor's or the infini_dist backend's) until the block ends; blocks may nest. A graph
    Inductor serves from its FX graph cache does not run the pass and is not listed."""
    return FUSION_PASS.log.recording()


def __getattr__(name):
    # Read at each access: the pass's log owns them, and last_sites is a new list per graph.
    if name in ("stats", "last_sites"):
        return getattr(FUSION_PASS.log, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_OPTION = "post_grad_custom_post_pass"
_installed: dict = {}  # what enable() replaced, and what it put there


def _takes_a_list() -> bool:
    # Newer torch (2.13 here) runs a list of post-grad passes; 2.11 takes exactly one.
    from torch._inductor import custom_graph_pass
    return hasattr(custom_graph_pass, "get_custom_graph_passes")


def _contains_ours(value) -> bool:
    if value is FUSION_PASS:
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains_ours(v) for v in value)
    return isinstance(value, _Chain) and any(_contains_ours(p) for p in value.passes)


class _Chain(CustomGraphPass):
    """Runs a pass the user already set, then ours (torch 2.11 takes only one pass)."""

    def __init__(self, *passes):
        self.passes = passes

    def __call__(self, graph):
        for p in self.passes:
            p(graph)

    def __eq__(self, other):  # a deep copy (transformers' CompileConfig) is the same chain
        return isinstance(other, _Chain) and self.passes == other.passes

    def __hash__(self):
        return hash(self.passes)

    def uuid(self):
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if any(i is None for i in ids) else repr(ids)  # None: not cacheable


def _with_ours(existing):
    if _contains_ours(existing):
        return existing
    if existing is None or (isinstance(existing, (list, tuple)) and not existing):
        return FUSION_PASS
    if _takes_a_list():
        return [*existing, FUSION_PASS] if isinstance(existing, (list, tuple)) \
            else [existing, FUSION_PASS]
    return _Chain(existing, FUSION_PASS)


@functools.cache  # once a process: the mode is read from the environment at Inductor's import
def _check_compile_mode() -> None:
    """Inductor's subprocess compile mode (TORCHINDUCTOR_FX_COMPILE_MODE=subprocess, with or
    without async+/progressive+) hands the compile to a child with its config minus the custom
    post-grad passes (torch drops them as unpicklable), so the pass would silently never run
    there: say so. The serialize mode compiles in this process and keeps them."""
    from torch._inductor import compile_fx
    mode = getattr(compile_fx, "fx_compile_mode", None)
    if mode is not None and mode.name == "SUBPROCESS":
        logging.getLogger("infini_dist").warning(
            "infini_dist: TORCHINDUCTOR_FX_COMPILE_MODE makes Inductor compile in a subprocess, "
            "which does not receive custom post-grad passes: the infini_dist pass will not run "
            "and every collective stays native. Unset it (or use 'serialize') to fuse them.")


def inductor_options(options: dict | None = None) -> dict:
    """`options` (default: none) plus our pass chained after the post-grad pass already set
    there or in Inductor's config. Pass the result to torch.compile(options=...)."""
    from torch._inductor import config as inductor_config
    _check_compile_mode()
    options = dict(options or {})
    existing = options.get(_OPTION, getattr(inductor_config, _OPTION))
    options[_OPTION] = _with_ours(existing)
    return options


def enable() -> None:
    """Install the pass in Inductor's config for every later torch.compile (idempotent)."""
    from torch._inductor import config as inductor_config
    _check_compile_mode()
    current = getattr(inductor_config, _OPTION)
    if _contains_ours(current):
        return
    installed = _with_ours(current)
    _installed.update(previous=current, installed=installed)
    setattr(inductor_config, _OPTION, installed)


def _without_ours(value):
    """`value` with our pass taken out, whatever shape it has now (None if nothing is left)."""
    if value is FUSION_PASS:
        return None
    if isinstance(value, (list, tuple)):
        rest = [p for p in (_without_ours(v) for v in value) if p is not None]
        return rest or None
    if isinstance(value, _Chain):
        rest = [p for p in (_without_ours(v) for v in value.passes) if p is not None]
        return None if not rest else rest[0] if len(rest) == 1 else _Chain(*rest)
    return value


def disable() -> None:
    """Undo enable(): restore what was there before if nothing changed since, else take our
    pass out of whatever is there now (passes set since are kept). Idempotent."""
    from torch._inductor import config as inductor_config
    current = getattr(inductor_config, _OPTION)
    installed, previous = _installed.get("installed"), _installed.get("previous")
    _installed.clear()  # never restore from a stale record on a later call
    if _contains_ours(current):
        setattr(inductor_config, _OPTION, previous if current is installed else
                _without_ours(current))


def compile_model(model, *, backend: str = "inductor", mode: str | None = None,
                  options: dict | None = None, recompile_decided: bool = True, **kwargs):
    """torch.compile with the infini_dist pass. With Inductor, `mode` is turned into its options
    (torch.compile takes mode or options, not both) and ours are added; backend='infini_dist'
    runs the pass without Inductor. `recompile_decided`: compile again at the first call after
    a site decided native or to fuse nothing, so that such sites become Inductor's own code
    (compile/recompile.py; a few times at most)."""
    if backend == BACKEND_NAME:
        if options or mode:
            raise ValueError("compile_model: mode and options apply to the Inductor backend only")
        compiled = torch.compile(model, backend=BACKEND_NAME, **kwargs)
        return recompiling(compiled, model) if recompile_decided else compiled
    if backend != "inductor":
        raise ValueError(f"compile_model: backend must be 'inductor' or {BACKEND_NAME!r}, "
                         f"got {backend!r}")
    merged = {}
    if mode is not None:
        from torch._inductor import list_mode_options
        merged.update(list_mode_options(mode, kwargs.get("dynamic")))
    merged.update(options or {})
    compiled = torch.compile(model, backend="inductor", options=inductor_options(merged), **kwargs)
    return recompiling(compiled, model) if recompile_decided else compiled
