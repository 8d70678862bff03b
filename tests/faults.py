"""Fault injection for tuning: a CPU algorithm that fails on chosen ranks at a chosen step, and
the per-rank record of one faulted tuning (outcome, seconds, cache validity) that the fault
matrix (test_reliability_faults.py) and the randomized trials (fault_trials.py) share."""

from __future__ import annotations

import json
import os
import time

import torch

from test_engine_consensus import ar_block_graph, inputs_for

# Where a fault can strike. A runner's calls are: 1 = trial, 2..1+warmup = warm-up, then reps.
# "diverge" strikes after tuning: see diverge_and_record.
STEPS = ("precompile", "trial", "warmup", "rep", "vote", "diverge")
DIVERGE_KINDS = ("hit/miss", "hit/hit")


class Fault:
    """step: one of STEPS; rep: which timed repetition (1-based); ranks: group ranks that fail;
    kind: 'raise', 'wrong' (a wrong answer) or 'exit' (the process dies); before: fail before
    the collective instead of after it."""

    def __init__(self, step, ranks=(1,), kind="raise", before=False, rep=2):
        self.step, self.ranks, self.kind, self.before, self.rep = step, tuple(ranks), kind, \
            before, rep

    def __repr__(self):
        if self.step == "diverge":
            return (f"{self.kind} divergence after {self.rep} agreed calls on ranks "
                    f"{list(self.ranks)}")
        where = f"rep {self.rep}" if self.step == "rep" else self.step
        side = " before the collective" if self.before else ""
        return f"{self.kind} at {where}{side} on ranks {list(self.ranks)}"

    def strike(self, rank):
        if rank not in self.ranks:
            return
        if self.kind == "exit":
            os._exit(17)
        raise RuntimeError(f"injected fault: {self}")

    def call_number(self, warmup):
        return {"trial": 1, "warmup": 2, "rep": 1 + warmup + self.rep}.get(self.step)


class FaultyAlgorithm:
    """The CPU fused all_reduce, with a fault injected on chosen ranks at a chosen step."""

    name = "faulty"

    def __init__(self, fault: Fault, warmup: int):
        from infini_dist.scheduler.torch_fused import TorchFusedAllReduce
        self.inner, self.fault, self.warmup = TorchFusedAllReduce(), fault, warmup

    def supports(self, span, meta, ctx):
        return self.inner.supports(span, meta, ctx)

    def compile(self, span, meta, ctx):
        fault = self.fault
        if fault.step == "precompile":
            fault.strike(ctx.rank)
        run = self.inner.compile(span, meta, ctx)
        calls = [0]
        strike_at = fault.call_number(self.warmup)

        def runner(env):
            calls[0] += 1
            if calls[0] == strike_at and fault.before:
                fault.strike(ctx.rank)
            out = run(env)
            if calls[0] == strike_at and not fault.before:
                if fault.kind == "wrong" and ctx.rank in fault.ranks:
                    return {k: v + 1.0 for k, v in out.items()}
                fault.strike(ctx.rank)
            return out
        return runner


def install(fault: Fault | None, warmup: int, group_rank: int):
    """Register the faulty algorithm and make it look fastest, so only a drop keeps it from
    winning. Returns an undo function."""
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.choices import register_algorithm, unregister_algorithm

    def hook(medians):
        if fault is not None and fault.step == "vote":
            fault.strike(group_rank)
        return {n: (1e-9 if n.startswith("faulty") else t) for n, t in medians.items()}
    if fault is not None:
        register_algorithm("all_reduce", "cpu", FaultyAlgorithm(fault, warmup))
    STORE.timing_hook = hook

    def undo():
        STORE.timing_hook = None
        unregister_algorithm("all_reduce", "cpu", FaultyAlgorithm.name)
    return undo


def expected_for(ranks, rows=4, hidden=16):
    """The ar_block_graph outputs for a group of these global ranks."""
    xs = sum(inputs_for(r, rows, hidden)["x"].double() for r in ranks) * 0.5
    ref = inputs_for(ranks[0], rows, hidden)
    total = xs + ref["res"].double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * ref["w"].double()
    return torch.relu(normed), total


def cache_valid(cache_dir) -> bool:
    """Every regular .json record parses and names a choice; no temp file is left."""
    if not os.path.isdir(cache_dir):
        return True
    for name in os.listdir(cache_dir):
        path = os.path.join(cache_dir, name)
        if name.endswith(".tmp"):
            return False
        if name.endswith(".json") and os.path.isfile(path) and not os.path.islink(path):
            try:
                with open(path) as f:
                    if not isinstance(json.load(f).get("choice"), str):
                        return False
            except (ValueError, OSError, AttributeError):
                return False
    return True


def tune_and_record(rank, group, group_ranks, settings) -> dict:
    """Tune the block once on `group` (a fresh executor) and record this rank's outcome."""
    from infini_dist.scheduler import engine
    started = time.monotonic()
    executor = engine.GraphExecutor(ar_block_graph(), settings)
    try:
        out = executor.run(inputs_for(rank), group=group)
        act, res = expected_for(group_ranks)
        right = (torch.allclose(out["act"].double(), act, rtol=1e-5, atol=1e-5) and
                 torch.allclose(out["res_out"].double(), res, rtol=1e-5, atol=1e-5))
        decision = executor.site_runners()[0].last_decision or {}
        outcome, message = ("ok" if right else "WRONG"), decision.get("choice", "")
    except Exception as error:  # noqa: BLE001 - the outcome is what we record
        outcome, message = type(error).__name__, str(error)
    return _row(rank, outcome, message, started, settings)


def _row(rank, outcome, message, started, settings) -> dict:
    return {"rank": rank, "outcome": outcome, "message": message,
            "seconds": time.monotonic() - started,
            "cache_valid": cache_valid(settings.cache_dir)}


def diverge_and_record(rank, group, group_rank, settings, fault: Fault) -> dict:
    """Tune the block on `group` at 4 rows (also at 8 for 'hit/hit'), make `fault.rep` agreed
    calls at 4 rows, then the ranks in `fault.ranks` call at 8 rows and the others at 4: a call
    cached on some ranks and new ('hit/miss') or cached differently ('hit/hit') on others. The
    right outcome is an error on every rank; a rank that returns from that call is WRONG."""
    from infini_dist.scheduler import engine
    executor = engine.GraphExecutor(ar_block_graph(), settings)
    for rows in (4, 8) if fault.kind == "hit/hit" else (4,):
        executor.run(inputs_for(rank, rows), group=group)
    for _ in range(fault.rep):
        executor.run(inputs_for(rank), group=group)
    started = time.monotonic()
    try:
        executor.run(inputs_for(rank, 8 if group_rank in fault.ranks else 4), group=group)
        outcome, message = "WRONG", "the divergent call returned"
    except Exception as error:  # noqa: BLE001 - the outcome is what we record
        outcome, message = type(error).__name__, str(error)
    return _row(rank, outcome, message, started, settings)
