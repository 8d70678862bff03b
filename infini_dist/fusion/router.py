"""FusionScheduler: decide per graph and input signature whether the fusing engine runs a graph or
its nodes run one by one through their torch references, then run it.

The decision (the *route*) is a pure function of the graph, the input shapes and dtypes, the
FusionConfig and infini_dist.config. Those are per rank, so a collective graph's route is agreed
across its group on a route-cache miss before any rank acts on it (fusion/agreement.py); cache
hits add an exchange only where every call is agreed (agree_every_call).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist

import infini_dist
from infini_dist.config import (FLAGS, Settings, check_bool, check_bool_or_auto,
                                check_nonneg_int, check_positive_int)
from infini_dist.fusion.agreement import agree_route, route_key
from infini_dist.scheduler import choices, engine, every_call
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.control import ControlPlaneError, control_plane
from infini_dist.scheduler.ir import SubGraph, as_names
from infini_dist.scheduler.boundary import is_anchor

log = logging.getLogger("infini_dist")

FUSED = "fused"
UNFUSED = "unfused"


# ---- config ---------------------------------------------------------------------------------------

def _check_whitelist(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = as_names(value, name, noun="op names")
    known = set(op_registry.registered_ops())
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"{name}: unknown ops {unknown}; known ops: "
                         f"{', '.join(sorted(known))} (register an op before whitelisting it)")
    return tuple(sorted(set(names)))


def _check_agree_mode(name: str, value: Any):
    return None if value is None else check_bool_or_auto(name, value)  # None: follow config


_FIELD_CHECKS = {
    "enable_fusion": check_bool,
    "enable_cache": check_bool,
    "min_nodes": check_positive_int,
    "min_tensor_size": check_nonneg_int,
    "op_whitelist": _check_whitelist,
    "fallback_on_error": check_bool,
    "debug_mode": check_bool,
    "agree_every_call": _check_agree_mode,
}


@dataclass
class FusionConfig:
    """How a FusionScheduler routes graphs. Every field is validated, also when set later.

    enable_fusion: False runs every graph node by node through the references.
    enable_cache: keep routing decisions per (graph, input signature, config), and let the engine
        persist its tuned decisions on disk (infini_dist.config.enable_disk_cache permitting).
    min_nodes: graphs with fewer nodes run unfused.
    min_tensor_size: graphs whose largest input has fewer elements run unfused (the largest, not
        every one: a norm weight is small by nature, the activations are what matter).
    op_whitelist: None allows every registered op; otherwise a graph holding any other op runs
        unfused. Names are checked against the op registry.
    fallback_on_error: when the fused path fails with a local error, warn and run unfused.
    debug_mode: log routing decisions, cache hits, tunings and fallbacks on the "infini_dist"
        logger (at WARNING, as the engine does in debug mode, so they show without setup).
    agree_every_call: None follows infini_dist.config.agree_every_call; True, False or "auto"
        overrides it for this scheduler's graphs (their engine sites included).
    """
    enable_fusion: bool = True
    enable_cache: bool = True
    min_nodes: int = 2
    min_tensor_size: int = 1024
    op_whitelist: tuple[str, ...] | None = None
    fallback_on_error: bool = True
    debug_mode: bool = False
    agree_every_call: bool | str | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise AttributeError(f"FusionConfig has no field {name!r}; fields: "
                                 f"{', '.join(_FIELD_CHECKS)}")
        super().__setattr__(name, check(f"FusionConfig.{name}", value))

    def key(self) -> tuple:
        """The field values, hashable: part of every routing-cache key."""
        return tuple(getattr(self, name) for name in _FIELD_CHECKS)


# ---- routing --------------------------------------------------------------------------------------

class Route(NamedTuple):
    path: str  # FUSED or UNFUSED
    reason: str


def choose_route(graph: SubGraph, shapes: tuple[tuple[int, ...], ...], config: FusionConfig,
                 settings: Settings) -> Route:
    """The heuristics, first refusal wins. Pure: the same answer on every rank for equal args."""
    if not config.enable_fusion:
        return Route(UNFUSED, "fusion is disabled (FusionConfig.enable_fusion=False)")
    if not settings.enable_custom_op_fusion:
        return Route(UNFUSED, "fusion is disabled (infini_dist.config.enable_custom_op_fusion="
                              "False)")
    if config.op_whitelist is not None:
        outside = sorted({node.op_type for node in graph.nodes} - set(config.op_whitelist))
        if outside:
            return Route(UNFUSED, f"ops {outside} are not in op_whitelist")
    if len(graph.nodes) < config.min_nodes:
        return Route(UNFUSED, f"{len(graph.nodes)} node(s) < min_nodes={config.min_nodes}")
    largest = max((math.prod(shape) for shape in shapes), default=0)
    if largest < config.min_tensor_size:
        return Route(UNFUSED, f"largest input has {largest} elements < min_tensor_size="
                              f"{config.min_tensor_size}")
    if not any(is_anchor(graph, i) for i in range(len(graph.nodes))):
        # The engine fuses only around anchors; without one it would run node by node anyway.
        return Route(UNFUSED, "nothing to fuse around (no all_reduce and no op with several "
                              "implementations)")
    return Route(FUSED, "passes every heuristic")


class _Entry(NamedTuple):
    route: Route
    settings: Settings
    executor: engine.GraphExecutor | None
    collective: bool
    ranks: Any  # the group the route is agreed on
    call_key: tuple | None  # set where every call is agreed: the route key to exchange


def _global_flags() -> tuple:
    # The raw flag values: cheaper to read and hash than a Settings snapshot on every dispatch.
    return tuple(getattr(infini_dist.config, name) for name in FLAGS)


def _is_collective(node) -> bool:
    return op_registry.get_op(node.op_type).kind == "collective"


def _collective_group(graph: SubGraph, group):
    """The group the graph's collectives run on: the first one's group_name attr, else `group`."""
    named = next((node.attr("group_name") for node in graph.nodes
                  if _is_collective(node) and node.attr("group_name")), None)
    return choices.resolve_group(named, group)


def group_size(group) -> int:
    """Ranks in `group` (None: WORLD); 1 outside a distributed run."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def _context(group, inputs: dict) -> choices.RunContext:
    device = next((t.device for t in inputs.values()), torch.device("cpu"))
    if dist.is_available() and dist.is_initialized():
        return choices.RunContext(group, dist.get_world_size(group), dist.get_rank(group), device)
    return choices.RunContext(group, 1, 0, device)


class FusionScheduler:
    """Runs SubGraphs, fused through the engine where the heuristics allow, else node by node.

    Tuned decisions belong to the engine (in memory and on disk, shared by every scheduler);
    this scheduler caches only its routing decisions, so `clear_cache` is local; where every
    call is agreed (agree_every_call) it is safe on any subset of ranks.
    """

    def __init__(self, config: FusionConfig | None = None):
        if config is None:
            config = FusionConfig()
        if not isinstance(config, FusionConfig):
            raise TypeError(f"config must be a FusionConfig or None, got {type(config).__name__}")
        self.config = config
        self._routes: dict[tuple, _Entry] = {}
        self._derived: dict[tuple, Settings] = {}  # (global flags, config) -> engine settings
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(("hits", "misses", "fused_dispatches",
                                     "unfused_dispatches", "fallbacks"), 0)

    # ---- public API ---------------------------------------------------------------------------
    def dispatch(self, graph: SubGraph, inputs_dict: Mapping[str, torch.Tensor],
                 group=None) -> dict[str, torch.Tensor]:
        """Run `graph` on `inputs_dict` (name -> tensor); returns {output name: tensor}.

        A graph with all_reduce is collective: call it on every rank of `group` (None: WORLD),
        with the same graph, shapes, dtypes and config.
        """
        inputs = self._check(graph, inputs_dict)
        entry = self._entry(graph, inputs, group)
        if entry.route.path == UNFUSED:
            self._bump("unfused_dispatches")
            return self._run_unfused(graph, inputs, group)
        self._bump("fused_dispatches")
        return self._run_fused(entry, graph, inputs, group)

    def route(self, graph: SubGraph, inputs_dict: Mapping[str, torch.Tensor]) -> Route:
        """Which path `dispatch` would take, and why; runs nothing, caches nothing."""
        inputs = self._check(graph, inputs_dict)
        settings = self._settings()
        return choose_route(graph, tuple(tuple(t.shape) for t in inputs.values()), self.config,
                            settings)

    def register_op(self, name: str, fn, **kw):
        """Register an op in the global registry (see scheduler/op_registry.register_op)."""
        spec = op_registry.register_op(name, fn, **kw)
        with self._lock:
            self._routes.clear()  # a re-registered op may have become an anchor
        return spec

    def get_cache_stats(self) -> dict[str, int]:
        """size (routing decisions cached), hits, misses, fused_dispatches, unfused_dispatches,
        fallbacks (fused dispatches that failed and ran unfused)."""
        with self._lock:
            return dict(self._stats, size=len(self._routes))

    def clear_cache(self) -> None:
        """Forget routing decisions and zero the counters. Tuned engine decisions are kept."""
        with self._lock:
            self._routes.clear()
            for name in self._stats:
                self._stats[name] = 0

    # ---- internals ----------------------------------------------------------------------------
    def _check(self, graph, inputs_dict) -> dict[str, torch.Tensor]:
        if not isinstance(graph, SubGraph):
            raise TypeError(f"graph must be a SubGraph, got {type(graph).__name__}")
        if not isinstance(inputs_dict, Mapping):
            raise TypeError(f"inputs_dict must be a mapping of name -> tensor, got "
                            f"{type(inputs_dict).__name__}")
        missing = [n for n in graph.input_names if n not in inputs_dict]
        unexpected = [n for n in inputs_dict if n not in graph.input_names]
        if missing or unexpected:
            raise ValueError(f"inputs do not match the graph's inputs {list(graph.input_names)}: "
                             f"missing {missing}, unexpected {unexpected}")
        inputs = {}
        for name in graph.input_names:  # graph order: the signature must not depend on dict order
            value = inputs_dict[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"input {name!r} must be a torch.Tensor, got "
                                f"{type(value).__name__}")
            inputs[name] = value
        return inputs

    def _bump(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._stats[name] += by

    def _settings(self, flags: tuple | None = None, config_key: tuple | None = None) -> Settings:
        """infini_dist.config's snapshot, with this scheduler's config folded in."""
        flags = flags if flags is not None else _global_flags()
        config_key = config_key if config_key is not None else self.config.key()
        settings = self._derived.get((flags, config_key))
        if settings is None:
            base = infini_dist.config.snapshot()
            settings = dataclasses.replace(
                base,
                enable_custom_op_fusion=base.enable_custom_op_fusion and self.config.enable_fusion,
                enable_disk_cache=base.enable_disk_cache and self.config.enable_cache,
                debug_mode=base.debug_mode or self.config.debug_mode,
                agree_every_call=(base.agree_every_call if self.config.agree_every_call is None
                                  else self.config.agree_every_call))
            self._derived[(flags, config_key)] = settings
        return settings

    def _debug(self, message: str, *args) -> None:
        if self.config.debug_mode:
            log.warning("infini_dist.fusion: " + message, *args)

    def _entry(self, graph: SubGraph, inputs: dict, group) -> _Entry:
        flags, config_key = _global_flags(), self.config.key()
        signature = tuple((tuple(t.shape), t.dtype) for t in inputs.values())
        device = next(iter(inputs.values())).device if inputs else torch.device("cpu")
        key = (graph, signature, config_key, flags, op_registry.generation(), group, device)
        caching = self.config.enable_cache
        if caching:
            entry = self._routes.get(key)
            if entry is not None:
                self._bump("hits")
                if self.config.debug_mode:  # signature() hashes the graph: not on the hot path
                    self._debug("cache hit for graph %s: %s", graph.signature()[:12],
                                entry.route.path)
                if entry.call_key is not None:
                    agree_route(entry.call_key, entry.route.reason, entry.ranks,
                                entry.settings.tuning_timeout_s)
                return entry
        self._bump("misses")
        settings = self._settings(flags, config_key)
        route = choose_route(graph, tuple(shape for shape, _ in signature), self.config, settings)
        collective = any(_is_collective(node) for node in graph.nodes)
        ranks = _collective_group(graph, group) if collective else None
        call_key = None
        if collective and group_size(ranks) > 1:
            agreed = every_call.wanted(settings.agree_every_call, device)
            call_key = route_key(graph, signature, route.path)
            with every_call.noting_cached_peers(agreed, settings.agree_every_call):
                agree_route(call_key, route.reason, ranks, settings.tuning_timeout_s)
            call_key = call_key if agreed else None
        executor = engine.executor_for(graph, settings) if route.path == FUSED else None
        entry = _Entry(route, settings, executor, collective, ranks, call_key)
        if caching:
            with self._lock:
                self._routes[key] = entry
        self._debug("routed graph %s %s: %s (%s)", graph.signature()[:12],
                    [list(shape) for shape, _ in signature], route.path, route.reason)
        return entry

    @staticmethod
    def _run_unfused(graph: SubGraph, inputs: dict, group) -> dict:
        env = dict(inputs)
        ctx = _context(group, inputs)
        for index, node in enumerate(graph.nodes):
            # A collective naming its group (as the compile pass does) runs there, as the
            # engine would run it; everything else takes the dispatch's group.
            named = node.attr("group_name")
            node_ctx = (dataclasses.replace(ctx, group=choices.resolve_group(named)) if named
                        else ctx)
            choices.run_nodes(graph, (index,), env, node_ctx)
        return {name: env[name] for name in graph.output_names}

    def _run_fused(self, entry: _Entry, graph: SubGraph, inputs: dict, group) -> dict:
        from infini_dist.scheduler.store import STORE
        before = (STORE.records.hits, STORE.records.misses)
        try:
            outputs = entry.executor.run(inputs, group)
        except (ControlPlaneError, engine.TuningError):
            # Verdicts the ranks reached together (or could not reach): never a local matter.
            raise
        except Exception as error:
            if not self.config.fallback_on_error:
                raise
            self._agree_on_fallback(entry, graph, group, error)
            text = (f"infini_dist.fusion: the fused path failed for graph "
                    f"{graph.signature()[:12]} ({type(error).__name__}: {error}); running it "
                    f"unfused")
            warnings.warn(text, RuntimeWarning, stacklevel=3)
            self._debug("fallback: %s", text)
            self._bump("fallbacks")
            return self._run_unfused(graph, inputs, group)
        if self.config.debug_mode:
            hits, misses = STORE.records.hits - before[0], STORE.records.misses - before[1]
            if misses:
                self._debug("tuned (compiled and benchmarked) %d site(s) of graph %s", misses,
                            graph.signature()[:12])
            if hits:
                self._debug("reused %d tuned decision(s) from the engine cache for graph %s",
                            hits, graph.signature()[:12])
        return outputs

    def _agree_on_fallback(self, entry: _Entry, graph: SubGraph, group, error: Exception) -> None:
        """A collective graph may fall back only if every rank failed: a rank running the
        unfused all_reduce alone would pair it with another rank's next call (a wrong answer or
        a hang). The failing ranks vote on the control plane; if some rank does not join (it
        succeeded), the vote times out into a ControlPlaneError instead."""
        group = _collective_group(graph, group)
        if not entry.collective or group_size(group) == 1:
            return
        ballot = ("infini_dist.fusion fallback", graph.signature())
        try:
            # Inside the try: a peer that succeeded may already have moved on and abandoned the
            # plane, so the rebuild times out too; the error must still name the real failure.
            plane = control_plane(group, entry.settings.tuning_timeout_s)
            votes = plane.all_gather(ballot, "fallback vote")
        except ControlPlaneError as vote_error:
            raise ControlPlaneError(
                f"infini_dist.fusion: the fused path failed on rank {dist.get_rank()} "
                f"({type(error).__name__}: {error}) and not every rank of the group did, so no "
                f"rank may fall back alone. {vote_error}") from error
        if any(vote != ballot for vote in votes):
            raise ControlPlaneError(
                f"infini_dist.fusion: ranks out of step during the fallback vote after "
                f"{type(error).__name__}: {error}; got {votes}") from error
