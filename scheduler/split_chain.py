"""Row-split chains: consecutive all-reduce sites of a prefill (a row-parallel GEMM, its
all-reduce + residual add + RMSNorm, and the GEMMs reading the norm) run either way, decided
once per chain by timing both in lockstep:

  sites  each site through the engine as the compile pass wrote it (its own committed choice:
         NCCL and Inductor's code, or one of our kernels), the readers' GEMMs as torch runs them;
  split  each site a reduce-scatter and an all-gather by copy engine under the GEMMs on either
         side of it (scheduler/split_site.py). The residual stream stays this rank's rows from
         site to site, which is why the chain decides as one: a site on the user's path would
         need every row of it.

The compile pass (infini_dist/compile/chain_match.py) writes a chain as a JSON text that every
op of it carries: per site its engine text, its sizes and its readers. The first site decides
the mode for the chain at its first call outside a CUDA-graph capture; every later call and op
runs that mode. Until then (a capture first) the sites run their own way, which writes every
row, so nothing depends on when the decision came.

The decision: each distinct site (sizes and readers) is timed both ways on random values of
its sizes, in lockstep on the group, the worst rank's medians weighted by how often the site
occurs; `split` is committed where the sites' total reaches its total times
`fusion_speedup_threshold`, as a fused choice must beat native (scheduler/benchmark.py). The
decision goes into the engine's decision cache (memory and disk, rank 0's lookup broadcast), so
a later process with the same chain, group size, device, flags and versions takes it untimed.
Split needs CUDA, one host, two or more ranks, libcuda and rows that cut into the ranks' parts;
any rank's reason not to split sends every rank site by site.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from infini_dist.kernels import cuda_driver
from infini_dist.kernels.symm_buffers import size_class, slot_elements
from infini_dist.kernels.symm_chain import MAX_ROW
from infini_dist.scheduler import lockstep, report
from infini_dist.scheduler.backends.symm_launch import tuning_of
from infini_dist.scheduler.cache import versions
from infini_dist.scheduler.choices import RunContext, resolve_group
from infini_dist.scheduler.control import control_plane
from infini_dist.scheduler.engine import site_executor
from infini_dist.scheduler.ir import subgraph_from_text
from infini_dist.scheduler.setup_thread import run_aside
from infini_dist.scheduler.split_site import Flags, SplitSite, gemm
from infini_dist.scheduler.split_ways import SITES, SPLIT, Ways, way, way_names
from infini_dist.scheduler.store import STORE

log = logging.getLogger("infini_dist")

# The split's buffers grow with rows (two sets, whatever the sites: 112 MiB at 2048 rows of
# 4096 bf16 at TP = 2); past this share of the device's memory the chain runs site by site.
MAX_MEMORY_SHARE = 0.1
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


@dataclass(frozen=True)
class ChainSite:
    """One site as the pass described it: the engine's text of the site (matmul -> all_reduce ->
    add_rms_norm, inputs x, w, residual, norm weight), x's rows and K, the norm's width, the
    producer weight's layout, eps, whether the site hands back its residual, and its readers:
    (N, transpose, bias) per GEMM, none for a copy of every row."""
    site: str
    rows: int
    k: int
    hidden: int
    transpose: bool
    eps: float
    residual_out: bool
    readers: tuple

    def unit(self) -> tuple:
        """What its timing depends on."""
        return (self.rows, self.k, self.hidden, self.transpose, self.readers)


def chain_text(group_name: str, dtype: torch.dtype, sites: list[ChainSite]) -> str:
    """The text the pass writes into every op of a chain."""
    texts = list(dict.fromkeys(s.site for s in sites))  # a model's sites share one or two
    return json.dumps({"group": group_name, "dtype": str(dtype), "texts": texts, "sites": [
        [texts.index(s.site), s.rows, s.k, s.hidden, s.transpose, s.eps, s.residual_out,
         [list(r) for r in s.readers]] for s in sites]}, separators=(",", ":"))


@functools.lru_cache(maxsize=64)
def parse_chain(text: str) -> tuple[str, torch.dtype, tuple[ChainSite, ...]]:
    """(group name, dtype, sites) of a chain's text."""
    spec = json.loads(text)
    sites = tuple(ChainSite(spec["texts"][i], r, k, h, t, e, o,
                            tuple(tuple(x) for x in readers))
                  for i, r, k, h, t, e, o, readers in spec["sites"])
    return spec["group"], _DTYPES[spec["dtype"]], sites


@functools.lru_cache(maxsize=256)
def _outputs(site: str) -> int:
    """How many values the site hands back (the norm's output, and the residual if read)."""
    return len(subgraph_from_text(site).output_names)


class ChainRunner:
    """Runs one chain's ops in the mode committed at its first site (see the module doc)."""

    def __init__(self, text: str, settings):
        self.settings = settings
        self.group_name, self.dtype, self.sites = parse_chain(text)
        self.mode = None  # decided at the first site's first call outside a capture
        self.decision: dict | None = None
        self.split: list[SplitSite] = []
        self.copy_stream = None

    # ---- the ops --------------------------------------------------------------------------
    def splits(self, index: int, inputs: list) -> bool:
        """Whether site `index` runs split; site 0's first call outside a capture decides."""
        if index == 0 and self.mode is None:
            self._decide(inputs)
        return self.mode == SPLIT

    def site(self, index: int, inputs: list) -> list:
        """Site `index` from [x, w, residual, norm weight]: [norm output, new residual], in the
        mode `splits` gave (site by site: through the engine's executor of the site)."""
        spec, (x, weight, residual, norm_weight) = self.sites[index], inputs
        if self.mode != SPLIT:
            executor = site_executor(spec.site, self.settings)
            out = executor.run(dict(zip(executor.graph.input_names, inputs)))
            return [out[name] for name in executor.graph.output_names]
        h, pre = self.split[index].produce(x.reshape(-1, spec.k), weight, spec.transpose,
                                           residual.reshape(-1, spec.hidden), norm_weight,
                                           spec.eps, keep=index > 0)
        return [h.view(residual.shape), pre.view(residual.shape)][:_outputs(spec.site)]

    def read(self, index: int, inputs: list) -> list:
        """Site `index`'s readers from [h, their weights (and biases)]: each GEMM's [rows, N],
        or a copy of h."""
        spec, h = self.sites[index], inputs[0]
        readers, operands = [], iter(inputs[1:])
        for _, transpose, bias in spec.readers:
            readers.append((next(operands), transpose, next(operands) if bias else None))
        if self.mode != SPLIT:
            rows = h.reshape(-1, spec.hidden)
            return [gemm(rows, w, t, b) for w, t, b in readers] if readers else [h.clone()]
        site = self.split[index]
        if h.data_ptr() != site.h.data_ptr():
            raise RuntimeError("infini_dist: a row-split read got another tensor than its "
                               "site's gathered rows (the graph was rewired after the pass)")
        outs = site.read(readers)
        if index == len(self.sites) - 1:  # the copy stream's work joins the chain once
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        return outs if readers else [outs[0].view(h.shape)]

    # ---- the decision ---------------------------------------------------------------------
    def buffer_bytes(self, world: int) -> int:
        """Device memory the split takes on each rank: two sets (sites k and k + 2 share one,
        scheduler/split_site.py) of symmetric scatter and gather buffers, a residual and the
        peers' parts."""
        total = 0
        for s in self.sites[:2]:
            rows = s.rows * s.hidden * self.dtype.itemsize
            total += 2 * size_class(rows) + rows + rows // world * (world - 1)
        return total

    def _unsupported(self, device, world: int) -> str | None:
        if device.type != "cuda":
            return "not on CUDA"
        if world < 2:
            return "one rank"
        if cuda_driver.driver() is None:
            return "no libcuda"
        for s in self.sites:
            if s.rows % world or slot_elements(s.rows // world * s.hidden) != s.rows // world \
                    * s.hidden:
                return f"{s.rows} rows do not cut into {world} equal parts"
            if s.hidden > MAX_ROW:
                return f"rows of {s.hidden} exceed the reduction's {MAX_ROW}"
        need = self.buffer_bytes(world)
        if need > torch.cuda.get_device_properties(device).total_memory * MAX_MEMORY_SHARE:
            return (f"its buffers ({need / 2**30:.1f} GiB) would take more than "
                    f"{MAX_MEMORY_SHARE:.0%} of the device's memory")
        return None

    def _decide(self, inputs: list) -> None:
        device = inputs[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            log.warning("infini_dist: a row-split chain has no decision before CUDA-graph "
                        "capture; its sites run their own way (warm up eagerly first)")
            return
        group = resolve_group(self.group_name)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        reason = self._unsupported(device, world)
        if world < 2:
            self._site_by_site(reason)
            return
        plane = control_plane(group, self.settings.tuning_timeout_s)

        def decide():
            with plane.lock:
                # A rank that cannot split (no libcuda, less memory) takes every rank with it:
                # the others would wait for it in the timing's exchanges.
                agreed = next((r for r in plane.all_gather(reason, "row split support") if r),
                              None)
                if agreed is None and not plane.single_host:
                    agreed = "ranks on several hosts"
                if agreed:
                    self._site_by_site(agreed)
                    return SITES
                return self._time(group, device, plane, world)
        self.mode = run_aside(decide, device)

    def _site_by_site(self, reason: str) -> None:
        self.mode, self.decision = SITES, {"mode": SITES, "reason": reason}
        log.info("infini_dist: row-split chain of %d sites runs site by site: %s",
                 len(self.sites), reason)

    def _build(self, group, device, plane) -> None:
        tuning = tuning_of(self.settings)
        self.copy_stream = torch.cuda.Stream(device)
        flags = Flags(group, device, len(self.sites), plane, tuning)
        self.split = []
        for i, s in enumerate(self.sites):
            self.split.append(SplitSite(i, s.rows, s.hidden, self.dtype, group, device,
                                        self.copy_stream, flags, tuning,
                                        like=self.split[i - 2] if i >= 2 else None))

    def _time(self, group, device, plane, world: int) -> str:
        """The chain's mode: from the decision cache (rank 0's lookup, broadcast), else timed;
        the split's buffers built only where it runs."""
        s = self.settings
        plane.agree(json.dumps([site.unit() for site in self.sites]), "row split chain",
                    "the chain's sites")
        key = self._cache_key(world, device)
        record = STORE.records.get_memory(key)
        if record is None and plane.rank == 0 and s.enable_disk_cache:
            record = STORE.records.read_disk(s.cache_dir, key)
        record = plane.broadcast(record if plane.rank == 0 else None, "row split cache lookup")
        if record is not None and not self._usable(record):  # the same verdict on every rank
            log.warning("infini_dist: a cached row-split decision does not fit its chain "
                        "(written by hand or by another version?); timing the chain again")
            record = None
        if record is not None and record["choice"] == SITES:
            self.decision = dict(record, source="cache")
            return SITES
        try:
            lockstep.agreed(s, plane, "row split buffers", lambda: self._build(group, device,
                                                                               plane))
        except Exception as error:  # noqa: BLE001 - agreed: every rank falls back together
            self.decision = {"mode": SITES, "reason": f"setup failed: {error}"}
            return SITES
        if record is not None:
            ways = {u["site"]: u["split"] for u in record["units"]}
            for indices in self._units().values():
                for index in indices:
                    self.split[index].parted, self.split[index].columns = way(ways[indices[0]])
            self.decision = dict(record, source="cache")
        else:
            self.decision = self._time_units(group, device, plane, world)
            record = dict(self.decision, choice=self.decision["mode"], source=None,
                          op=f"row_split_chain x{len(self.sites)}", bucket=self.sites[0].rows,
                          dtypes=[str(self.dtype)], world_size=world,
                          device=report.device_name(device), versions=versions())
            STORE.records.put_memory(key, record)
            if plane.rank == 0 and s.enable_disk_cache:
                STORE.records.write_disk(s.cache_dir, key, record)
        mode = self.decision["mode"]
        if mode == SITES:
            self.split = []  # their buffers stay cached for later chains; the views go
        else:
            STORE.split_sites.update((site.site, site.rows) for site in self.sites)
        return mode

    def _usable(self, record) -> bool:
        """Whether a cached record can decide this chain: site by site, or the split with a
        way this chain offers at each of its distinct sites."""
        if not isinstance(record, dict) or record.get("choice") not in (SITES, SPLIT):
            return False
        if record["choice"] == SITES:
            return True
        try:
            ways = {u["site"]: u["split"] for u in record["units"]}
        except (KeyError, TypeError):
            return False
        return all(ways.get(indices[0]) in way_names(self.sites[indices[0]])
                   for indices in self._units().values())

    def _units(self) -> dict[tuple, list[int]]:
        """The chain's distinct sites (ChainSite.unit), each with the indices where it occurs;
        a decision's units are named by their first index."""
        units: dict = {}
        for index, site in enumerate(self.sites):
            units.setdefault(site.unit(), []).append(index)
        return units

    def _cache_key(self, world: int, device) -> str:
        """What the decision depends on: the sites' sizes and readers, the group's size, the
        device, the flags that decide choices, the versions."""
        payload = json.dumps({"row_split_chain": [site.unit() for site in self.sites],
                              "dtype": str(self.dtype), "world": world,
                              "device": report.device_name(device),
                              "settings": self.settings.decision_fields(), **versions()},
                             sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def _time_units(self, group, device, plane, world: int) -> dict:
        """Each distinct site timed every way in lockstep; the decision (module doc)."""
        s = self.settings
        ctx = RunContext(group, world, plane.rank, device)
        totals = {SITES: 0.0, SPLIT: 0.0}
        units = []
        for indices in self._units().values():
            ways = Ways(self, indices[0], device)
            lockstep.agreed(s, plane, "row split first run", ways.first_run)
            worst = {c.name: math.inf for c in ways.choices}  # a way that failed to time
            worst.update(lockstep.worst_medians(s, ways.choices, None, ctx, plane))
            best = min((c for c in ways.choices if c.name != SITES), key=lambda c: worst[c.name])
            for index in indices:
                self.split[index].parted, self.split[index].columns = way(best.name)
            units.append({"site": indices[0], "count": len(indices), "times_s": worst,
                          "split": best.name})
            totals[SITES] += worst[SITES] * len(indices)
            totals[SPLIT] += worst[best.name] * len(indices)
            del ways
        mode = SPLIT if totals[SITES] >= totals[SPLIT] * s.fusion_speedup_threshold else SITES
        plane.agree(mode, "row split decision", "the chain's mode")
        if plane.rank == 0:
            log.info("infini_dist: row-split chain of %d sites at %d rows -> %s (%.1f us split "
                     "against %.1f us site by site)", len(self.sites), self.sites[0].rows, mode,
                     totals[SPLIT] * 1e6, totals[SITES] * 1e6)
        return {"mode": mode, "totals_s": totals, "units": units, "world": world,
                "rows": self.sites[0].rows, "sites": len(self.sites)}


def chain_runner(text: str, settings) -> ChainRunner:
    """The process's runner of chain `text` under `settings`."""
    key = (text, settings)
    runner = STORE.chains.get(key)
    if runner is None:
        runner = STORE.chains[key] = ChainRunner(text, settings)
    return runner


def chain_decisions() -> list[dict]:
    """What each row-split chain that ran decided (None before its first call)."""
    return [dict(runner.decision or {}, sites=len(runner.sites))
            for runner in list(STORE.chains.values())]
