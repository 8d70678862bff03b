"""Deferred choice, end to end: run a graph, and tune each site across its group on first sight.

Per site and token bucket (scheduler/buckets.py: tuned at the bound, compiled per exact count),
all ranks of the site's group, in lockstep over the control plane: agree on the signature ->
agree on cache hit/miss -> agree on the choice list -> precompile in a thread pool and drop what
failed anywhere -> per choice: trial run checked against the fp32 reference, failures dropped
everywhere, then timed -> medians combined by MAX -> pick (native unless a choice beats it by the
speed-up threshold; ties by name) -> rank 0's pick broadcast and checked -> commit to the cache.
The reference is never timed or committed; the fallback is `native`, the user's own path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import torch
import torch.distributed as dist

from infini_dist.scheduler.settings import Settings
from infini_dist.scheduler import benchmark, buckets, data_plane, every_call, lockstep, report
from infini_dist.scheduler.cache import versions
from infini_dist.scheduler.choices import (NATIVE, Choice, RunContext, TensorMeta,
                                           generate_choices, native_choice, resolve_group,
                                           run_nodes)
from infini_dist.scheduler.control import ControlPlane, control_plane
from infini_dist.scheduler.lockstep import TuningError
from infini_dist.scheduler.ir import SubGraph, subgraph_from_text
from infini_dist.scheduler.boundary import Site, find_sites, site_subgraph
from infini_dist.scheduler.op_registry import close_enough, generation, get_op
from infini_dist.scheduler.setup_thread import run_aside
from infini_dist.scheduler.shapes import site_meta
from infini_dist.scheduler.store import STORE

log = logging.getLogger("infini_dist")


class SiteRunner:
    """One site of one graph: its decision per token bucket, compiled per exact signature."""

    def __init__(self, graph: SubGraph, site: Site, settings: Settings, compiled: bool = False):
        self.graph = graph
        self.site = site
        self.settings = settings
        self.compiled = compiled  # the site sits in a torch.compile'd graph: Inductor is native
        self.native_path = "inductor" if compiled else "eager"
        self.sub = site_subgraph(graph, site)
        self.inputs = self.sub.input_names
        self.outputs = self.sub.output_names
        self.has_collective = any(get_op(graph.nodes[a].op_type).kind == "collective"
                                  for a in site.anchors)
        # Scatter and gather tie rows to ranks (dim 0 splits W ways): tuned per exact shape.
        self.bucketed = not any(graph.nodes[i].op_type in ("reduce_scatter", "all_gather")
                                for i in site.region)
        self.group_name = graph.nodes[site.anchors[0]].attr("group_name")
        # A matmul prologue's weight and bias have no token rows, whatever their shape.
        self.fixed = frozenset(name for i in site.region if graph.nodes[i].op_type == "matmul"
                               for name in graph.nodes[i].inputs[1:])
        self._committed: dict[tuple, Choice] = {}  # exact local signature -> compiled choice
        # Local signatures whose calls are agreed (agree_every_call) -> (key, on CUDA); empty
        # otherwise, so the hot path pays one truth test when the flag is off.
        self._call_keys: dict[tuple, tuple] = {}
        # This site's decisions per bucket signature live in STORE under this key.
        self.key = STORE.site_key(graph, settings, compiled, site.anchors[0])
        self._lock = threading.Lock()
        self.last_tuning: dict | None = None  # set when this runner benchmarked
        self.last_decision: dict | None = None  # set by tuning or by a cache hit

    def run(self, env: dict, group) -> dict:
        values, group, local = self._signature(env, group)
        choice = self._committed.get(local)
        if choice is None:
            with self._lock:
                choice = self._committed.get(local)
                if choice is None:
                    return self._decide(values, group, local)
        if self._call_keys:
            every_call.agree_cached(self._call_keys.get(local), group,
                                    self.settings.tuning_timeout_s)
        return choice.run(values)

    def _signature(self, env: dict, group) -> tuple[dict, object, tuple]:
        """(this site's inputs, its group, the exact signature its choices are committed by)."""
        values = {name: env[name] for name in self.inputs}
        group = resolve_group(self.group_name, group)
        # torch.Size hashes and compares as the tuple it is: no copy per call.
        return values, group, (id(group),) + tuple(
            (v.shape, v.dtype, v.is_contiguous(), v.device) if isinstance(v, torch.Tensor)
            else (type(v), v) for v in values.values())

    def committed(self, values: dict, group=None) -> Choice | None:
        """What a call with these inputs runs without tuning or agreeing first, if anything."""
        return None if self._call_keys else self._committed.get(self._signature(values, group)[2])

    def decided(self, values: dict, group=None):
        """The Decision (store.py) committed in this process for the token bucket of these
        inputs, if any: no communication, and shapes are all it reads (fake tensors do)."""
        values, group, _ = self._signature(values, group)
        tokens = self._tokens(values)
        return STORE.decided.get((self.key, (id(group),) + buckets.signature(values, tokens)))

    def _tokens(self, values: dict):
        return buckets.tokens_of(values, self.settings, self.fixed) if self.bucketed else None

    # ---- deciding ----------------------------------------------------------------------------
    def _context(self, values: dict, group) -> RunContext:
        device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)),
                      torch.device("cpu"))
        ranks = ((dist.get_world_size(group), dist.get_rank(group))
                 if self.has_collective or dist.is_initialized() else (1, 0))
        return RunContext(group, *ranks, device, settings=self.settings)

    def candidates(self, values: dict, ctx: RunContext) -> tuple[list[Choice], dict, dict]:
        """(choices, meta, reference) for these inputs: one pass through the fp32 references
        gives the expected outputs and every intermediate's shape and dtype, from which the
        choices are made."""
        env = dict(values)
        run_nodes(self.graph, self.site.region, env, ctx)
        reference = {name: env[name] for name in self.outputs}
        meta = {n: TensorMeta.of(v) for n, v in env.items() if isinstance(v, torch.Tensor)}
        return self._choices(meta, ctx), meta, reference

    def _choices(self, meta: dict, ctx: RunContext) -> list[Choice]:
        s = self.settings
        return generate_choices(self.graph, self.site, meta, ctx,
                                fusion_types=s.custom_op_fusion_types,
                                max_depth=s.max_fusion_depth, recursive=s.enable_recursive_fusion,
                                enable_fusion=s.enable_custom_op_fusion, compiled=self.compiled)

    def _decide(self, values: dict, group, local: tuple) -> dict:
        """Commit a choice for these exact shapes: its token bucket's decision (tuned or loaded
        across the group at the bucket's first count), compiled for them; this call's outputs.
        Every rank sees the same counts in the same order (agreed), so each takes the same path."""
        ctx = self._context(values, group)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            log.warning("infini_dist: no decision for %s before CUDA-graph capture; running it "
                        "natively (warm up eagerly first)", self.sub.signature()[:12])
            return self._native(ctx).run(values)  # never tuned inside a capture, not committed
        distributed = dist.is_initialized() and ctx.world_size > 1
        plane = control_plane(group, self.settings.tuning_timeout_s) if distributed else None
        if plane is not None:
            ctx = dataclasses.replace(ctx, single_host=plane.single_host)
        agreed = distributed and every_call.wanted(self.settings.agree_every_call, ctx.device)
        # One tuning at a time per plane, this call's run included: threads tuning different
        # sites would interleave their exchanges and collectives. Ranks that order the threads
        # differently fail the signature check on every rank instead.
        with plane.lock if plane is not None else contextlib.nullcontext():
            if agreed:  # the same exchange as a cached call: a peer's hit pairs with this miss
                every_call.agree_site(group, self.settings.tuning_timeout_s,
                                      every_call.site_key(self.sub, values, None))
            # Off the caller's thread and stream: nothing made here can land in a CUDA-graph pool.
            choice = run_aside(lambda: self._decide_aside(values, ctx, plane, agreed), ctx.device)
            self._committed[local] = choice
            if agreed:
                self._call_keys[local] = (every_call.site_key(self.sub, values, choice.name),
                                          ctx.device.type == "cuda")
            return choice.run(values)

    def _decide_aside(self, values: dict, ctx: RunContext, plane: ControlPlane | None,
                      agreed: bool) -> Choice:
        tokens = self._tokens(values)
        bucket = (id(ctx.group),) + buckets.signature(values, tokens)
        # Every new exact signature is agreed, inside a decided bucket too: ranks whose counts
        # differ but share a bucket would otherwise each compile for their own.
        signature = {"subgraph": self.sub.signature(), "bucket": tokens and tokens.bound,
                     "inputs": [(n, tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                                else (n, repr(v)) for n, v in values.items()]}
        if plane is not None:
            with every_call.noting_cached_peers(agreed, self.settings.agree_every_call):
                plane.agree(signature, "signature", "input shapes and dtypes")
        decided = STORE.decided.get((self.key, bucket))
        if decided is None:
            tuned = buckets.at_bound(values, tokens) if tokens else values
            choice = self._tune(tuned, ctx, plane, baseline_only=any(
                isinstance(v, torch.Tensor) and (not v.dtype.is_floating_point or v.numel() == 0)
                for v in tuned.values()))
            # The committed choice's first call (collective setup after a cache hit: symmetric
            # buffers, rendezvous, launch binding) happens here too, in lockstep on every rank,
            # at the bucket bound: buffers are sized for every count of the bucket. Agreed: a
            # rank failing before its collective must not leave its peers inside theirs.
            lockstep.agreed(self.settings, plane, "first run", lambda: choice.run(tuned))
            STORE.commit(self.key, bucket, choice)
            if buckets.same_layout(values, tuned):
                return choice
            decided = choice
        choice = self._specialize(decided.name, values, ctx, plane)
        lockstep.agreed(self.settings, plane, "first run", lambda: choice.run(values))
        return choice

    def _specialize(self, name: str, values: dict, ctx: RunContext, plane) -> Choice:
        """The committed `name` compiled for these exact shapes. Where it cannot run them
        (support is a pure function of shapes, so every rank finds the same) or failed to
        compile on any rank (agreed), native."""
        try:
            meta = site_meta(self.graph, self.site.region, values, ctx.device)
            choices = self._choices(meta, ctx)
        except Exception:  # noqa: BLE001 - a user op without meta support: one real pass
            choices, meta, _ = self.candidates(values, ctx)  # (the same on every rank)
        chosen = next((c for c in choices if c.name == name), None)
        if chosen is None:
            log.info("infini_dist: %s cannot run %s; native runs them", name,
                     {n: tuple(m.shape) for n, m in meta.items() if n in values})
            return self._native(ctx)
        try:
            chosen.precompile(meta, ctx)
            error = None
        except Exception as exc:  # noqa: BLE001 - it compiled at the bucket bound: agreed below
            error = f"{type(exc).__name__}: {exc}"
        if not lockstep.agree_failures(self.settings, [chosen], {chosen.name: error}, plane,
                                       "precompile (count)"):
            return self._native(ctx)
        return chosen

    def _native(self, ctx):
        # Eager torch even for a compiled site: nothing to compile here (maybe under capture).
        choice = native_choice(self.graph, self.site)
        choice.precompile({}, ctx)
        return choice

    def _key(self, values, ctx, names: list[str]) -> str:
        # The choice list is part of the key: a decision made where a backend was missing (no
        # ninetoothed on that run) or a choice is new must not stand in for a tuning among the
        # choices this process has.
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        return self.sub.cache_key([t.dtype for t in tensors], [t.shape for t in tensors],
                                  group_size=ctx.world_size, device=report.device_name(ctx.device),
                                  settings=self.settings.decision_fields(),
                                  native=self.native_path, choices=names, **versions())

    def _about(self, values, ctx) -> dict:
        tokens = self._tokens(values)
        return report.describe(self.sub, values, tokens and tokens.bound, ctx)

    def _tune(self, values, ctx, plane: ControlPlane | None, baseline_only: bool) -> Choice:
        s = self.settings
        if baseline_only:
            log.debug("infini_dist: int or empty input for %s: native", self.sub)
            return self._native(ctx)
        choices, meta, reference = lockstep.agreed(s, plane, "reference run",
                                                   lambda: self.candidates(values, ctx))
        names = [c.name for c in choices]
        if plane is not None:
            plane.agree(names, "choice list", "the set of choices")
        key = self._key(values, ctx, names)
        record = STORE.records.get_memory(key)
        rank0 = plane is None or plane.rank == 0
        if record is None and rank0 and s.enable_disk_cache:
            record = STORE.records.read_disk(s.cache_dir, key)
        if plane is not None:
            record = plane.broadcast(record if rank0 else None, "cache lookup")
        STORE.records.count(hit=record is not None)
        if record is None and not s.tune_at_request_time:
            # The lookup was broadcast, so every rank raises here together.
            raise TuningError(f"infini_dist: no decision for {self._about(values, ctx)} and "
                              f"config.tune_at_request_time is False; warm this shape up first "
                              f"(infini_dist.warmup or `infini-dist tune`)")
        if record is not None:
            chosen = [c for c in choices if c.name == record["choice"]]
            if chosen and not lockstep.drop_failed(self.settings, chosen, meta, ctx, plane,
                                                   "precompile (hit)"):
                chosen = []
            if chosen:
                log.debug("infini_dist: cache hit %s -> %s", key[:12], record["choice"])
                self.last_decision = dict(record, source="cache")
                return chosen[0]
            log.warning("infini_dist: cached choice %r is unavailable; tuning again",
                        record["choice"])
        return self._benchmark(choices, values, reference, meta, ctx, plane, key)

    def _benchmark(self, choices, values, reference, meta, ctx, plane, key) -> Choice:
        s = self.settings
        started = time.perf_counter()
        choices = lockstep.drop_failed(self.settings, choices, meta, ctx, plane, "precompile")
        precompile_s = time.perf_counter() - started
        survivors = []
        replicated = True
        floats = [v.dtype for v in values.values()
                  if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
        computed_in = max(floats, key=lambda d: torch.finfo(d).eps, default=None)
        for choice in choices:
            if plane is not None:
                plane.barrier(f"start {choice.name}")
            error, digest = None, None
            try:
                with data_plane.bounded(lockstep.data_timeout(s), f"trial {choice.name}"):
                    out = choice.run(values)
                wrong = [n for n in reference
                         if not close_enough(out[n], reference[n], computed_in)]
                if wrong and choice.name == NATIVE:
                    # The user's own path stays the fallback; the reference only vets ours.
                    log.warning("infini_dist: native output %s of %s is off the fp32 reference "
                                "by more than the tolerance", wrong, self.sub.signature()[:12])
                elif wrong:
                    error = f"output {wrong} differs from the fp32 reference"
                digest = data_plane.digest(out)
            except Exception as exc:  # noqa: BLE001 - a failing choice is dropped, not fatal
                error = data_plane.describe(exc)
            if not lockstep.agree_failures(s, [choice], {choice.name: error}, plane,
                                           f"trial {choice.name}"):
                continue
            # Where native gives every rank the same bits, a fused choice must too.
            digests = plane.all_gather(digest, f"digest {choice.name}") if plane else [digest]
            if choice.name == NATIVE:
                replicated = len(set(digests)) == 1
            elif replicated and len(set(digests)) > 1:
                log.warning("infini_dist: dropping %s: outputs differ across ranks", choice.name)
                continue
            survivors.append(choice)
        worst = lockstep.worst_medians(s, survivors, values, ctx, plane)
        survivors = [c for c in survivors if c.name in worst]
        native_like = {c.name for c in survivors if c.fuses_nothing}
        mine = benchmark.pick(worst, NATIVE, native_like, s.fusion_speedup_threshold)
        if plane is not None:
            plane.agree(mine, "decision", "the chosen choice")
        record = dict(self._about(values, ctx), choice=mine, native=self.native_path,
                      times_s=worst, candidates=[c.name for c in survivors],
                      subgraph=self.sub.canonical(), precompile_s=precompile_s,
                      tuning_s=time.perf_counter() - started)
        STORE.records.put_memory(key, record)
        if (plane is None or plane.rank == 0) and s.enable_disk_cache:
            STORE.records.write_disk(s.cache_dir, key, record)
        self.last_tuning = record
        self.last_decision = dict(record, source="tuned")
        report.tuned_site(record, key, loud=s.debug_mode,
                          announce=plane is None or plane.rank == 0)
        return next(c for c in survivors if c.name == mine)


class GraphExecutor:
    """Runs a SubGraph: loose nodes through their references, sites through their decisions.
    `compiled`: the graph is a site torch.compile put in place (its native path is Inductor's)."""

    def __init__(self, graph: SubGraph, settings: Settings, compiled: bool = False):
        self.graph = graph
        self.settings = settings
        types = settings.custom_op_fusion_types if settings.enable_custom_op_fusion else ()
        self.sites = find_sites(graph, types)
        in_region = {i: s for s in self.sites for i in s.region}
        self.plan = []
        for index in range(len(graph.nodes)):
            site = in_region.get(index)
            if site is None:
                self.plan.append(("node", index))
            elif index == site.anchors[0]:
                # Prologue nodes are private to their anchor, so running them here is safe.
                self.plan.append(("site", SiteRunner(graph, site, settings, compiled)))
        self.has_loose = any(kind == "node" for kind, _ in self.plan)
        one = self.plan[0][1] if len(self.plan) == 1 and not self.has_loose else None
        # A graph that is one site (every eager op): calls go straight to its runner.
        self.single_site = one if one and set(one.outputs) == set(graph.output_names) else None
        self._only_names = frozenset(graph.input_names)

    def run(self, inputs: dict, group=None, entry=None, scalar: float = 0.0) -> dict:
        """`entry` (cpp_launch.Entry, with the `scalar` its key leaves out): offered the launch."""
        if self.single_site is not None and inputs.keys() == self._only_names:
            if entry is not None and entry.call is None:
                entry.start(self, inputs)
            out = self.single_site.run(inputs, group)
            if entry is not None:
                entry.executor = self
                entry.offer(self, inputs, group, scalar)
            return out
        missing = [n for n in self.graph.input_names if n not in inputs]
        if missing:
            raise ValueError(f"missing graph inputs: {missing}")
        env = dict(inputs)
        # Loose nodes are never collectives (every collective is a site), so they need only
        # the group for their references' signature, not the rank or device.
        loose = RunContext(group, 1, 0, torch.device("cpu")) if self.has_loose else None
        for kind, item in self.plan:
            if kind == "node":
                run_nodes(self.graph, (item,), env, loose)
            else:
                env.update(item.run(env, group))
        return {name: env[name] for name in self.graph.output_names}

    def site_runners(self) -> list[SiteRunner]:
        return [item for kind, item in self.plan if kind == "site"]


def executor_for(graph: SubGraph, settings: Settings, compiled: bool = False) -> GraphExecutor:
    """The executor of `graph` under `settings` (the caller's infini_dist.config.snapshot())."""
    key = (graph, settings, compiled, generation())  # a re-registered op: built afresh
    executor = STORE.executors.get(key)
    if executor is None:
        executor = STORE.executors[key] = GraphExecutor(graph, settings, compiled)
    return executor


def site_executor(text: str, settings: Settings) -> GraphExecutor:
    """The executor of a compiled site, `text` its SubGraph's canonical text: no parse per call."""
    key = (text, settings, generation())
    executor = STORE.sites.get(key)
    if executor is None:
        executor = STORE.sites[key] = executor_for(subgraph_from_text(text), settings, True)
    return executor
