"""Choices for a site, and their recursive generation.

A *choice* computes a whole site region (prologue + anchors + epilogue) from the region's external
inputs. It is a list of steps: single nodes run as plain torch runs them (their native
implementations), and at most one *fused span* that an `Algorithm` compiles. Every choice of a site
yields the same values, so they can be timed against each other and checked against the fp32
references. The `native` choice (no span: the user's own path) is the fallback and what every
other choice must beat.

Backends plug in by `register_algorithm(op_type, device_type, algorithm)`; the generator asks each
algorithm which spans it supports and builds one choice per supported (prologue, epilogue) depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from infini_dist.scheduler.settings import Settings
from infini_dist.scheduler import op_registry, sum_first
from infini_dist.scheduler.ir import SubGraph
from infini_dist.scheduler.boundary import Site, external_inputs, live_outputs


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    contiguous: bool

    @classmethod
    def of(cls, value) -> "TensorMeta":
        return cls(tuple(value.shape), value.dtype, value.device, value.is_contiguous())


@dataclass(frozen=True)
class RunContext:
    group: object  # the data-plane ProcessGroup (None means WORLD)
    world_size: int
    rank: int
    device: torch.device
    # Every rank of the group on one host (the control plane compares host ids). NVLink-only
    # algorithms need it; default True where there is no group to ask.
    single_host: bool = True
    # The engine's settings; the kernel launch knobs (symm_*, fast_launch) come from here.
    # None: the kernels' defaults.
    settings: Settings | None = None


def resolve_group(name: str | None, default=None):
    """The process group a collective node's `group_name` attribute names, else `default`."""
    if not name:
        return default
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


@dataclass(frozen=True)
class FusedSpan:
    """The nodes one algorithm runs as a unit, with the values it reads and must produce."""
    graph: SubGraph
    prologue: tuple[int, ...]
    anchors: tuple[int, ...]
    epilogue: tuple[int, ...]
    beside: tuple[int, ...] = ()  # work run while the collective is in flight (runs_beside)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(sorted(self.beside + self.prologue + self.anchors + self.epilogue))

    @property
    def inputs(self) -> tuple[str, ...]:
        return external_inputs(self.graph, self.indices)

    @property
    def outputs(self) -> tuple[str, ...]:
        return live_outputs(self.graph, self.indices)

    def nodes(self, indices):
        return [self.graph.nodes[i] for i in indices]

    @property
    def fuses_anything(self) -> bool:
        """False for a lone anchor: its algorithm then runs the collective alone."""
        return bool(self.beside or self.prologue or self.epilogue or len(self.anchors) > 1)


Runner = Callable[[dict], dict]


class Algorithm:
    """One way to run an anchor, optionally with neighbours fused. Subclass and register.

    `supports` must be a pure function of its arguments: every rank must answer the same, or the
    ranks would disagree on the choice set (which the engine detects and reports).
    """
    name: str = "algorithm"
    # True: the algorithm takes a site's beside work into its span and is offered only where
    # there is some; every other algorithm's choices run that work first, natively.
    runs_beside: bool = False

    def supports(self, span: FusedSpan, meta: dict[str, TensorMeta], ctx: RunContext) -> bool:
        raise NotImplementedError

    def compile(self, span: FusedSpan, meta: dict[str, TensorMeta], ctx: RunContext) -> Runner:
        """Build the runner: env (name -> tensor) in, {live output name: tensor} out. Do all
        compilation and validation here; it runs before any timed, cross-rank call."""
        raise NotImplementedError


_ALGORITHMS: dict[tuple[str, str], list[Algorithm]] = {}


def register_algorithm(op_type: str, device_type: str, algorithm: Algorithm) -> None:
    _load_backend(device_type)  # the built-in algorithms come first, as they always have
    entries = _ALGORITHMS.setdefault((op_type, device_type), [])
    if any(a.name == algorithm.name for a in entries):
        raise ValueError(f"algorithm {algorithm.name!r} already registered for "
                         f"{op_type} on {device_type}")
    entries.append(algorithm)


def unregister_algorithm(op_type: str, device_type: str, name: str) -> None:
    _load_backend(device_type)
    entries = _ALGORITHMS.get((op_type, device_type), [])
    entries[:] = [a for a in entries if a.name != name]


def _load_cuda() -> None:
    from infini_dist.scheduler.backends import cuda  # noqa: F401 - registers on import


def _load_cpu() -> None:
    from infini_dist.scheduler import torch_fused  # noqa: F401 - registers on import


# Backends whose algorithms register on import, loaded the first time their device is seen.
BACKEND_LOADERS = {"cuda": _load_cuda, "cpu": _load_cpu}
_loaded_backends: set[str] = set()


def _load_backend(device_type: str) -> None:
    if device_type in _loaded_backends or device_type not in BACKEND_LOADERS:
        return
    _loaded_backends.add(device_type)
    try:
        BACKEND_LOADERS[device_type]()
    except ImportError as error:
        import logging
        logging.getLogger("infini_dist").warning(
            "infini_dist: %s backend unavailable (%s); only native choices", device_type, error)


def algorithms_for(op_type: str, device_type: str) -> list[Algorithm]:
    _load_backend(device_type)
    spec = op_registry.get_op(op_type)
    if spec.kind == "custom":
        return [ImplementationAlgorithm(name, fn) for name, fn in spec.implementations.items()]
    return list(_ALGORITHMS.get((op_type, device_type), []))


def run_nodes(graph: SubGraph, indices, env: dict, ctx: RunContext, native: bool = False) -> None:
    """Run nodes one by one through their references (or native implementations), in place on
    env."""
    for index in indices:
        node = graph.nodes[index]
        values = op_registry.run_node(node.op_type, [env[n] for n in node.inputs],
                                      node.attr_dict, ctx.group, native)
        env.update(zip(node.outputs, values))


class ImplementationAlgorithm(Algorithm):
    """A user op's implementation, with its epilogue chain run in the same function."""

    def __init__(self, impl_name: str, fn: Callable):
        self.name = f"impl:{impl_name}"
        self.fn = fn

    def supports(self, span, meta, ctx):
        return not span.prologue and len(span.anchors) == 1

    def compile(self, span, meta, ctx):
        anchor = span.graph.nodes[span.anchors[0]]
        attrs = anchor.attr_dict
        outputs = span.outputs

        def run(env):
            local = dict(env)
            result = self.fn(*[local[n] for n in anchor.inputs], **attrs)
            local.update(zip(anchor.outputs, result if isinstance(result, tuple) else (result,)))
            run_nodes(span.graph, span.epilogue, local, ctx)
            return {n: local[n] for n in outputs}
        return run


class Choice:
    def __init__(self, name: str, steps: list, graph: SubGraph, site: Site,
                 span: FusedSpan | None = None, algorithm: Algorithm | None = None):
        self.name = name
        self.graph = graph
        self.site = site
        # ("nodes", indices: run natively), ("span", span), or ("inductor", InductorSteps: a
        # compiled site's unfused epilogue, run as Inductor compiles it)
        self.steps = steps
        self.span = span
        self.algorithm = algorithm
        self._runner: Runner | None = None
        self._direct = False
        self.outputs = live_outputs(graph, site.region)

    @property
    def fuses_nothing(self) -> bool:
        """Native, or a collective of ours with every other op of the site run natively."""
        return self.span is None or not self.span.fuses_anything

    def precompile(self, meta: dict[str, TensorMeta], ctx: RunContext) -> None:
        self._ctx = ctx
        if self.span is not None:
            self._runner = self.algorithm.compile(self.span, meta, ctx)
        for kind, payload in self.steps:
            if kind == "inductor":
                payload.prepare(meta)
        self._direct = self._whole_span

    @property
    def _whole_span(self) -> bool:
        """One fused span that is the whole site: its runner's result is the choice's."""
        return (self._runner is not None and len(self.steps) == 1
                and set(self.span.outputs) == set(self.outputs))

    def bound_runner(self):
        """What every call of this choice runs once its first call bound it (a symmetric-memory
        choice's PreparedLaunch), where its one span is the whole site; else None."""
        return getattr(self._runner, "prepared", None) if self._direct else None

    def run(self, inputs: dict) -> dict:
        if self._direct:
            return self._runner(inputs)
        env = dict(inputs)
        for kind, payload in self.steps:
            if kind == "nodes":
                run_nodes(self.graph, payload, env, self._ctx, native=True)
            elif kind == "inductor":
                payload.run(env, self._ctx, self.name)
            else:
                env.update(self._runner(env))
        return {name: env[name] for name in self.outputs}

    def __repr__(self):
        return f"Choice({self.name})"


NATIVE = "native"


def native_choice(graph: SubGraph, site: Site, compiled: bool = False,
                  name: str = NATIVE) -> Choice:
    """The user's own path: the collective through torch.distributed, the other nodes as plain
    torch ops in eager mode, or for a `compiled` site (one torch.compile put there) the epilogue
    as Inductor compiles it."""
    if compiled:
        from infini_dist.scheduler.native_inductor import InductorNativeChoice
        return InductorNativeChoice(graph, site, name)
    return Choice(name, [("nodes", site.region)], graph, site)


def _unfused_epilogue(graph: SubGraph, indices: tuple[int, ...], compiled: bool) -> list:
    """The steps after a fused span that runs only part of the epilogue. In a compiled site
    native's epilogue is Inductor's code, so these nodes are too: the same handicap on both
    sides, and the code a committed choice runs is as fast as the user's graph would have made
    it."""
    if not compiled:
        return [("nodes", indices)]
    from infini_dist.scheduler.native_inductor import InductorSteps, leading_compilable
    head, tail = leading_compilable(graph, indices)
    return ([("inductor", InductorSteps(graph, head))] if head else []) + \
        ([("nodes", tail)] if tail else [])


def _depths(limit: int, enabled: bool, recursive: bool) -> list[int]:
    if not enabled or limit == 0:
        return [0]
    return list(range(limit + 1)) if recursive else [limit]


def generate_choices(graph: SubGraph, site: Site, meta: dict[str, TensorMeta], ctx: RunContext,
                     *, fusion_types, max_depth: int, recursive: bool,
                     enable_fusion: bool = True, compiled: bool = False) -> list[Choice]:
    """The native choice first, then every supported fused choice, in a deterministic order."""
    fused = _fused_choices(graph, site, site, meta, ctx, [], "", set(fusion_types), max_depth,
                           recursive, enable_fusion, compiled)
    summed = sum_first.rewrite(graph, site, meta) if enable_fusion and recursive else None
    if summed is not None:  # coalesced all_reduces only added up: one all_reduce of the sum
        new_graph, new_site, new_meta = summed
        fused.append(native_choice(new_graph, new_site, compiled, sum_first.PREFIX + NATIVE))
        fused += _fused_choices(new_graph, new_site, new_site, new_meta, ctx, [], sum_first.PREFIX,
                                set(fusion_types), max_depth, recursive, enable_fusion, compiled)
    return [native_choice(graph, site, compiled)] + fused


def _fused_choices(graph, root, site, meta, ctx, prefix, prefix_name, fusion_types, max_depth,
                   recursive, enable_fusion, compiled) -> list[Choice]:
    # `root` is the whole site; `site` is what is left of it after peeling coalesced anchors.
    anchor_op = graph.nodes[site.anchors[0]].op_type
    longest_prologue = max((len(c) for c in site.prologue_of), default=0)
    prologue_depths = _depths(min(longest_prologue, max_depth),
                              enable_fusion and "prologue" in fusion_types, recursive)
    epilogue_depths = _depths(min(len(site.epilogue), max_depth),
                              enable_fusion and "epilogue" in fusion_types, recursive)
    choices = []
    for algorithm in algorithms_for(anchor_op, ctx.device.type):
        # a registered algorithm need not subclass Algorithm: no attribute, no beside work
        runs_beside = getattr(algorithm, "runs_beside", False)
        if runs_beside and not site.beside:
            continue
        beside = site.beside if runs_beside else ()
        first = [("nodes", site.beside)] if site.beside and not beside else []
        for p in prologue_depths:
            fused_prologue = tuple(sorted(i for chain in site.prologue_of
                                          for i in chain[len(chain) - min(p, len(chain)):]))
            unfused_prologue = tuple(i for i in site.prologue if i not in fused_prologue)
            for e in epilogue_depths:
                span = FusedSpan(graph, fused_prologue, site.anchors, site.epilogue[:e], beside)
                if not algorithm.supports(span, meta, ctx):
                    continue
                steps = first + list(prefix)
                if unfused_prologue:
                    steps.append(("nodes", unfused_prologue))
                steps.append(("span", span))
                if site.epilogue[e:]:
                    steps += _unfused_epilogue(graph, site.epilogue[e:], compiled)
                name = f"{prefix_name}{algorithm.name}[p{p},e{e}]"
                choices.append(Choice(name, steps, graph, root, span, algorithm))
    if len(site.anchors) > 1 and recursive:
        # Peel the first anchor off a coalesced group, run it alone, and recurse on the rest.
        head = site.prologue_of[0] + (site.anchors[0],)
        rest = Site(site.anchors[1:], tuple(i for i in site.prologue if i not in head),
                    site.epilogue, site.prologue_of[1:])
        choices += _fused_choices(graph, root, rest, meta, ctx, prefix + [("nodes", head)],
                                  f"{prefix_name}split{site.anchors[0]}+", fusion_types,
                                  max_depth, recursive, enable_fusion, compiled)
    return choices
