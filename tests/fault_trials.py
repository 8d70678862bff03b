"""Randomized fault trials: world sizes 2-4, a random group per trial, a random fault (or none)
on random ranks at a random tuning step. The processes live across trials (one run_ranks per
world size), as a long job's would, so a fault that leaves state behind shows in later trials.

One fault kind is a divergence after agreed calls (faults.diverge_and_record): some ranks call
with a shape cached or new on them while the others repeat a cached one; every rank must raise.

Counts, per world size: hangs (a rank's outcome later than tuning_timeout_s + slack, or a run
that never finishes), divergent commits (ranks of one group ending differently: some committed,
some not, or different choices) and wrong answers.

    python tests/fault_trials.py --trials 500     # from the repo root; prints a JSON summary
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faults import (DIVERGE_KINDS, STEPS, Fault, diverge_and_record, install,  # noqa: E402
                    tune_and_record)
from multirank import run_ranks  # noqa: E402

TIMEOUT_S = 3.0
SLACK_S = 5.0


def random_fault(rng: random.Random, size: int) -> Fault | None:
    if rng.random() < 0.2:
        return None
    step = rng.choice(STEPS)
    if step == "diverge":  # some ranks, never all, take the other shape
        ranks = sorted(rng.sample(range(size), rng.randint(1, size - 1)))
        return Fault(step, ranks, rng.choice(DIVERGE_KINDS), rep=rng.randint(1, 3))
    kind = "wrong" if step == "trial" and rng.random() < 0.3 else "raise"
    before = step in ("trial", "warmup", "rep") and kind == "raise" and rng.random() < 0.4
    ranks = sorted(rng.sample(range(size), rng.randint(1, size)))
    return Fault(step, ranks, kind, before, rep=rng.randint(1, 3))


def trial_loop(rank, world_size, trials, seed):
    import torch.distributed as dist

    import infini_dist
    from infini_dist.scheduler.cache import DECISIONS
    from infini_dist.scheduler.control import control_plane
    report = control_plane(None, 120.0)  # its own plane: never part of a trial
    base_dir = infini_dist.config.cache_dir
    summaries = []
    for t in range(trials):
        rng = random.Random(f"{seed}/{world_size}/{t}")  # the same draws on every rank
        members = sorted(rng.sample(range(world_size), rng.randint(2, world_size)))
        fault = random_fault(rng, len(members))
        # A fresh data group per trial: a fault before a collective leaves its group out of step.
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        DECISIONS.clear()
        row = None
        if rank in members:
            diverging = fault is not None and fault.step == "diverge"
            undo = install(None if diverging else fault, warmup=1,
                           group_rank=members.index(rank))
            try:
                # Depth 1: fewer choices per trial, every step still there to fault.
                with infini_dist.config.patch(tuning_timeout_s=TIMEOUT_S, benchmark_warmup=1,
                                              benchmark_reps=3, max_fusion_depth=1,
                                              cache_dir=os.path.join(base_dir, str(t))):
                    settings = infini_dist.config.snapshot()
                    row = (diverge_and_record(rank, group, members.index(rank), settings, fault)
                           if diverging else tune_and_record(rank, group, members, settings))
            finally:
                undo()
        rows = [r for r in report.all_gather(row, f"trial {t}") if r is not None]
        if all(r["outcome"] == "ok" for r in rows):
            dist.destroy_process_group(group)  # a group left out of step is kept, not joined
        if rank == 0:
            summaries.append({"trial": t, "members": members, "fault": repr(fault),
                              "outcomes": [r["outcome"] for r in rows],
                              "messages": [r["message"][:300] for r in rows],
                              "choices": sorted({r["message"] for r in rows
                                                 if r["outcome"] == "ok"}),
                              "seconds": max(r["seconds"] for r in rows),
                              "cache_valid": all(r["cache_valid"] for r in rows)})
    return summaries


def _divergent(s):
    ok = [o == "ok" for o in s["outcomes"]]
    return (any(ok) and not all(ok)) or len(s["choices"]) > 1


def _hang(s):
    return s["seconds"] > TIMEOUT_S + SLACK_S


def summarize(summaries: list[dict]) -> dict:
    return {"trials": len(summaries),
            "hangs": sum(_hang(s) for s in summaries),
            "divergent": sum(_divergent(s) for s in summaries),
            "wrong": sum("WRONG" in s["outcomes"] for s in summaries),
            "committed": sum(all(o == "ok" for o in s["outcomes"]) for s in summaries),
            "failed_everywhere": sum(all(o != "ok" for o in s["outcomes"]) for s in summaries),
            "cache_invalid": sum(not s["cache_valid"] for s in summaries),
            "slowest_s": round(max((s["seconds"] for s in summaries), default=0.0), 2),
            "faults": sum(s["fault"] != "None" for s in summaries),
            "divergences": sum("divergence" in s["fault"] for s in summaries),
            "divergences_caught": sum("divergence" in s["fault"] and
                                      all(o == "RankMismatchError" for o in s["outcomes"])
                                      for s in summaries)}


def run(trials: int, seed: int = 0, world_sizes=(2, 3, 4)) -> dict:
    """Trials split over the world sizes; a run that does not finish counts as a hang."""
    started = time.monotonic()
    result = {}
    for world_size in world_sizes:
        count = trials // len(world_sizes) + (world_size == world_sizes[0]) * (
            trials % len(world_sizes))
        budget = 60 + count * (TIMEOUT_S + SLACK_S)
        try:
            summaries = run_ranks(trial_loop, world_size, count, seed, timeout=budget)[0]
            result[world_size] = dict(summarize(summaries), details=[
                s for s in summaries if _divergent(s) or _hang(s)][:5])
        except (TimeoutError, RuntimeError) as error:
            result[world_size] = {"trials": count, "hangs": "run did not finish",
                                  "error": str(error)[-2000:]}
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(run(args.trials, args.seed), indent=1))
