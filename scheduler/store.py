"""The engine's one decision store, `STORE`: the executors this process built, the choice each
site committed per token bucket (with a version number), the tuned records by cache key, and the
entries through which callers reach the committed launches the C++ table holds
(kernels/express.py, scheduler/cpp_launch.py).

The engine writes it. The compile pass and the recompiler only read it (compile/decided.py,
compile/recompile.py); eager ops and the compiled site op reach it through engine.executor_for,
engine.site_executor and their `Entry`. Nothing else at module level is shared between the engine,
compile and eager layers (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import NamedTuple

from infini_dist.kernels import express
from infini_dist.scheduler.cache import DecisionCache


class Decision(NamedTuple):
    """What a site committed for a token bucket: all the pass and the engine read back (the
    compiled choice itself stays with its runner, which frees it with its buffers)."""
    name: str
    fuses_nothing: bool

    @property
    def native(self) -> bool:
        from infini_dist.scheduler.choices import NATIVE  # choices' ops import the store
        return self.name == NATIVE

    def rewrites(self, beyond_collective: bool) -> bool:
        """Whether the compile pass writes the site otherwise once it knows this decision
        (compile/decided.py): native is left to Inductor, and a collective of ours with nothing
        fused leaves the site's other ops (`beyond_collective`: it has some) to Inductor."""
        return self.native or (self.fuses_nothing and beyond_collective)


class DecisionStore:
    def __init__(self):
        self.executors: dict = {}  # (graph, settings, compiled, op generation) -> GraphExecutor
        self.sites: dict = {}  # (compiled site text, settings, op generation) -> GraphExecutor
        # (site key: SiteRunner.key, bucket signature) -> the Decision committed for that bucket
        self.decided: dict = {}
        self._serials = itertools.count()
        self.version = 0  # bumped at every commit: readers recompute only when it moved
        self.static_texts: set[str] = set()  # compiled sites whose every dim is a plain int
        self.entries: dict = {}  # eager op name or compiled site text -> Entry
        self.chains: dict = {}  # (row-split chain text, settings) -> split_chain.ChainRunner
        # (site text, rows) of the sites of chains committed to the row split: the pass writes
        # them again as sites, whatever the site alone decided, so that the chain forms again.
        self.split_sites: set = set()
        # A compiled site with run-time attributes (scheduler/run_time_attrs.py): its text ->
        # {the values it ran with: the site text with those values}
        self.bound: dict[str, dict[tuple, str]] = {}
        # Tuned records by cache key, in memory (disk: cache.py), with hit and miss counts.
        self.records = DecisionCache()
        # Test hook: transforms this rank's medians before they are shared (timing noise,
        # a forced winner); None in use.
        self.timing_hook = None

    # ---- written by the engine -------------------------------------------------------------
    def site_key(self, graph, settings, compiled: bool, anchor: int) -> tuple:
        """A new site's key: each runner decides afresh (a fresh executor tunes again)."""
        return graph, settings, compiled, anchor, next(self._serials)

    def commit(self, site_key: tuple, bucket: tuple, choice) -> None:
        self.decided[site_key, bucket] = Decision(choice.name, choice.fuses_nothing)
        self.version += 1

    def entry(self, key: str, group_name: str | None = None) -> Entry:
        """The C++ table entry of an eager op (`key` its name) or a compiled site (its text)."""
        entry = self.entries.get(key)
        if entry is None:
            from infini_dist.scheduler.cpp_launch import Entry  # it builds on the engine
            entry = self.entries[key] = Entry(len(self.entries), group_name)
        return entry

    def forget_launches(self) -> None:
        """Drop the C++ table's records: the settings or an op's definition changed."""
        express.clear()

    # ---- the compile pass, the recompiler and reports: read (the pass notes static sites,
    # and run_time_attrs.bind the texts it makes of one) -----------------------------------
    def note_static(self, text: str) -> None:
        """The pass compiled site `text` with every dim a plain int: its decisions change what
        the pass writes (a symbolic token count has no bucket)."""
        self.static_texts.add(text)

    def digest(self, static_only: bool = False) -> str:
        """Digest of the compiled sites' decisions that change what the pass writes
        (`Decision.rewrites`); `static_only`: of sites compiled with static shapes alone. A
        collective alone that decided ours is written the same again, so compiling again for
        it would only cost the compile."""
        parts = []
        for ((graph, _, compiled, _, _), bucket), choice in list(self.decided.items()):
            if compiled and choice.rewrites(len(graph.nodes) > 1):
                text = graph.canonical()
                if not static_only or text in self.static_texts:
                    parts.append((text, repr(bucket), choice.name))
        return hashlib.sha256(repr(sorted(parts)).encode()).hexdigest()

    def site_executors(self) -> list:
        """(site text, settings, executor) for every compiled site that ran in this process."""
        return [(text, settings, executor)
                for (text, settings, _), executor in list(self.sites.items())]


STORE = DecisionStore()

