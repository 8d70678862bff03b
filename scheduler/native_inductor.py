"""The native choice of a compiled site: the code Inductor would have run there without our pass.

Inside a torch.compile'd graph the user's own path is not eager torch: it is the collective
(NCCL, through torch.distributed) followed by the epilogue as Inductor compiles it. That is what a
fused choice of a compiled site has to beat, so the native choice there runs the prologue and
the collectives natively and the epilogue through `torch.compile(fullgraph=True)`
in the default mode, one compiled function per (epilogue, input dtypes and row length), cached
for the process (Dynamo makes the token count dynamic after the first count it sees).

A fused choice of a compiled site that covers only part of the epilogue runs the rest the same
way (`InductorSteps`): timed against native's compiled epilogue, an eager rest would lose by the
launches Inductor saves, and once committed it would run slower than the user's graph.

Compiling happens on the first run with new shapes, which the engine makes at tune time (its
trial run) or right after a cache hit, never inside a CUDA-graph capture: a run under capture
with shapes not compiled yet uses eager torch instead. A compile that fails falls back to eager
torch as well, with a warning: the native path must always run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types

import torch

from infini_dist.scheduler import op_registry
from infini_dist.scheduler.choices import NATIVE, Choice, run_nodes
from infini_dist.scheduler.boundary import external_inputs, live_outputs

log = logging.getLogger("infini_dist")

# (epilogue nodes, inputs, outputs, metas) -> compiled fn, or None where compiling failed
_COMPILED: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _epilogue_function(steps, inputs, outputs, name):
    """A plain function running `steps` ((native fn, inputs, outputs, attrs) each) with a code
    object of its own: Dynamo keeps compiled code, and its recompile limit, per code object, so
    sites sharing one would evict each other."""
    def epilogue(*values):
        env = dict(zip(inputs, values))
        for fn, node_inputs, node_outputs, attrs in steps:
            result = fn(*[env[n] for n in node_inputs], **attrs)
            env.update(zip(node_outputs, result if isinstance(result, tuple) else (result,)))
        return tuple(env[n] for n in outputs)
    code = epilogue.__code__.replace(co_name=name)
    return types.FunctionType(code, epilogue.__globals__, name, None, epilogue.__closure__)


def epilogue_key(nodes, inputs, outputs, metas) -> tuple:
    return tuple(nodes), tuple(inputs), tuple(outputs), tuple(metas)


def compiled_epilogue(key: tuple):
    """The torch.compile'd native epilogue for this `epilogue_key` (made once; None if it
    failed to compile before)."""
    nodes, inputs, outputs, _ = key
    with _LOCK:
        if key in _COMPILED:
            return _COMPILED[key]
        steps = []
        for node in nodes:
            spec = op_registry.get_op(node.op_type)
            steps.append((spec.native or spec.fn, node.inputs, node.outputs, node.attr_dict))
        plain = _epilogue_function(steps, inputs, outputs, f"native_epilogue_{len(_COMPILED)}")
        fn = _COMPILED[key] = torch.compile(plain, fullgraph=True, backend=_counted_inductor)
        return fn


_GRAPHS = [0]  # Dynamo graphs handed to Inductor for native epilogues (a recompile counts)


def _counted_inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx
    with _LOCK:
        _GRAPHS[0] += 1
    # No post-grad passes: ours has no collective to find here, and a user's own were
    # written for their graphs, not for this one.
    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": None})


def _failed(key: tuple) -> None:
    with _LOCK:
        _COMPILED[key] = None


def epilogues_compiled() -> int:
    """How many Dynamo graphs the native epilogues of this process compiled: reports subtract
    them from the user's own graph count."""
    return _GRAPHS[0]


def _automatic_dynamic():
    """Dynamo's automatic dynamic shapes, which an epilogue keyed without the token count needs
    (one recompile at most). Our site runs inside the user's compiled code, and under
    torch.compile(dynamic=False) Dynamo turns them off while that code runs: each count would
    compile the epilogue anew, up to the recompile limit and a hard failure (fullgraph)."""
    import torch._dynamo.config as dynamo_config
    if dynamo_config.automatic_dynamic_shapes:
        return contextlib.nullcontext()
    return dynamo_config.patch(automatic_dynamic_shapes=True)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def leading_compilable(graph, indices) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`indices` split where its first collective is: the nodes before it Inductor may compile
    (fullgraph, no process group), the rest (a sequence-parallel span's all_gather and what
    follows it) run through torch.distributed."""
    for k, index in enumerate(indices):
        if op_registry.get_op(graph.nodes[index].op_type).kind == "collective":
            return tuple(indices[:k]), tuple(indices[k:])
    return tuple(indices), ()


class InductorSteps:
    """Nodes of a compiled site run as Inductor compiles them, as the user's compiled graph
    would have run them: a compiled site's native epilogue, and the unfused rest of a fused
    choice that covers only part of the epilogue (timed against native's compiled epilogue, it
    must run compiled too, or the comparison handicaps it)."""

    def __init__(self, graph, indices):
        self.graph = graph
        self.indices = tuple(indices)
        self.inputs = external_inputs(graph, self.indices)
        self.outputs = live_outputs(graph, self.indices)
        self._compiled = None
        self._key = None
        self._ready: set[tuple] = set()  # input shapes the compiled code has run with

    def prepare(self, meta) -> None:
        # Keyed without the leading (token) dims: one compiled function serves every count,
        # and Dynamo's automatic dynamic shapes recompile it once at most.
        self._key = epilogue_key([self.graph.nodes[i] for i in self.indices], self.inputs,
                                 self.outputs,
                                 [(len(m.shape), m.shape[-1:], m.dtype, m.device)
                                  for m in (meta[n] for n in self.inputs)])
        self._compiled = compiled_epilogue(self._key)

    @property
    def uses_inductor(self) -> bool:
        """Whether the nodes run Inductor's code (False before `prepare` or after a failed
        compile)."""
        return self._compiled is not None

    def run(self, env: dict, ctx, owner: str) -> None:
        """Run the nodes on `env` in place; `owner` names the choice in a fallback's warning."""
        result = self._call([env[n] for n in self.inputs], owner)
        if result is None:
            run_nodes(self.graph, self.indices, env, ctx, native=True)
        else:
            env.update(zip(self.outputs, result))

    def _call(self, values, owner: str) -> tuple | None:
        # A site may read a graph input itself (the residual); where the user marked it with
        # torch._dynamo.mark_dynamic, the mark would fail this compile (the epilogue ties the
        # marked dim to an unmarked one: ConstraintViolationError). A detached alias has none.
        values = [v.detach() if hasattr(v, "_dynamo_dynamic_indices") else v for v in values]
        shapes = tuple(v.shape for v in values)
        # The site runs inside a compiled graph (no autograd of its own) and is tuned on a
        # no-grad thread: one grad mode everywhere, or Dynamo's guards recompile per mode.
        if self._compiled is not None and shapes in self._ready:
            with torch.no_grad(), _automatic_dynamic():
                return self._compiled(*values)
        if self._compiled is None or _capturing():
            return None  # eager torch: never compile under a CUDA-graph capture
        try:
            with torch.no_grad(), _automatic_dynamic():
                result = self._compiled(*values)  # compiles on the first call
        except Exception as error:  # noqa: BLE001 - these nodes must run: eager torch instead
            log.warning("infini_dist: Inductor could not compile the nodes %s of %s (%s: %s); "
                        "running them in eager torch", list(self.indices), owner,
                        type(error).__name__, error)
            self._compiled = None
            _failed(self._key)
            return None
        self._ready.add(shapes)
        return result


class InductorNativeChoice(Choice):
    """`native` for a compiled site: collectives through torch.distributed, epilogue by Inductor."""

    def __init__(self, graph, site, name: str = NATIVE):
        eager = tuple(i for i in site.region if i not in site.epilogue)
        super().__init__(name, [("nodes", eager)], graph, site)
        # A sequence-parallel span ends in its all_gather, which runs after Inductor's part.
        compiled, self.after = leading_compilable(graph, site.epilogue)
        self.epilogue = InductorSteps(graph, compiled) if compiled else None

    def precompile(self, meta, ctx) -> None:
        super().precompile(meta, ctx)
        if self.epilogue is not None:
            self.epilogue.prepare(meta)

    @property
    def uses_inductor(self) -> bool:
        """Whether the epilogue runs Inductor's code (False before precompile or after a failed
        compile)."""
        return self.epilogue is not None and self.epilogue.uses_inductor

    def run(self, inputs: dict) -> dict:
        env = dict(inputs)
        run_nodes(self.graph, self.steps[0][1], env, self._ctx, native=True)
        if self.epilogue is not None:
            self.epilogue.run(env, self._ctx, self.name)
        run_nodes(self.graph, self.after, env, self._ctx, native=True)
        return {name: env[name] for name in self.outputs}
