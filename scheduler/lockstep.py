"""The lockstep steps of tuning one site: every rank runs them in the same order, and every
failure on any rank is agreed over the control plane (a choice dropped everywhere, or tuning
stopped everywhere with a clear error), so the ranks never leave tuning out of step.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

from infini_dist.scheduler import benchmark, data_plane
from infini_dist.scheduler.choices import NATIVE, Choice
from infini_dist.scheduler.data_plane import DataPlaneError, describe, guarded
from infini_dist.scheduler.store import STORE

log = logging.getLogger("infini_dist")


class TuningError(RuntimeError):
    pass


def data_timeout(settings) -> float:
    # Half the control timeout: a rank stuck in a collective still reaches the next
    # control exchange before its peers there give up on it.
    return settings.tuning_timeout_s / 2


def agreed(settings, plane, step: str, fn):
    """fn() on every rank; a failure on any rank fails every rank. The failing rank
    re-raises its own error (a TypeError where torch raises one), its peers a TuningError."""
    own = None
    try:
        with data_plane.bounded(data_timeout(settings), step):
            result = fn()
    except Exception as error:  # noqa: BLE001 - agreed on below
        own = error
    errors = plane.all_gather(describe(own) if own else None, step) if plane else [None]
    if own is not None:
        raise own
    failed = [(plane.ranks[r], e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise TuningError(f"infini_dist: tuning failed at step {step!r} on rank "
                          f"{failed[0][0]}: {failed[0][1]}")
    return result


def drop_failed(settings, choices, meta, ctx, plane, step) -> list[Choice]:
    def precompile(choice):
        try:
            choice.precompile(meta, ctx)
            return None
        except Exception as error:  # any failure just removes the choice
            return describe(error)
    threads = min(settings.max_autotune_threads, max(1, len(choices)))
    if os.environ.get("TRITON_INTERPRET") == "1":
        threads = 1  # the interpreter patches triton.language while a kernel runs
    with ThreadPoolExecutor(max_workers=threads) as pool:
        errors = dict(zip([c.name for c in choices], pool.map(precompile, choices)))
    if threads > 1:
        # A failure beside other compiles gets one more try alone: not every library's
        # compile step is thread-safe, and a race must not cost the site a choice.
        for choice in choices:
            if errors[choice.name] is not None:
                first, errors[choice.name] = errors[choice.name], precompile(choice)
                if errors[choice.name] is None:
                    log.warning("infini_dist: %s failed to compile beside other choices "
                                "(%s) and compiled alone", choice.name, first)
    return agree_failures(settings, choices, errors, plane, step)


def agree_failures(settings, choices, errors: dict, plane, step) -> list[Choice]:
    gathered = plane.all_gather(errors, step) if plane is not None else [errors]
    failed = {}
    for rank, errs in enumerate(gathered):
        for name, err in errs.items():
            if err is None:
                continue
            if DataPlaneError.__name__ in err:  # whichever rank reported it
                raise TuningError(f"infini_dist: tuning stopped at step {step!r}: the "
                                  f"ranks' collectives went out of step (rank {rank}: "
                                  f"{err}); the group's data plane cannot be trusted until "
                                  f"it is rebuilt")
            failed.setdefault(name, f"rank {rank}: {err}")
    for name, err in failed.items():
        if name == NATIVE:
            raise TuningError(f"infini_dist: the native path failed at step {step!r} "
                              f"({err})")
        (log.warning if settings.debug_mode else log.info)(
            "infini_dist: dropping choice %s at %s: %s", name, step, err)
    return [c for c in choices if c.name not in failed]


def time_choices(settings, choices, values, ctx, plane) -> dict[str, float]:
    """This rank's median per choice. On CUDA, under graph replay when every rank could
    capture every choice (production decode replays graphs; eager timing would mostly
    measure host launch overhead), else eagerly for all: one mode per site, agreed."""
    s = settings
    if ctx.device.type == "cuda" and s.benchmark_cuda_graphs:
        medians = {}
        for choice in choices:
            if plane is not None:
                plane.barrier(f"graph {choice.name}")
            graph, error = benchmark.capture(lambda: choice.run(values), ctx.device,
                                             s.benchmark_warmup)
            errors = plane.all_gather(error, f"capture {choice.name}") if plane else [error]
            if any(errors):
                log.info("infini_dist: timing eagerly, %s cannot be captured: %s",
                         choice.name, next(e for e in errors if e))
                break
            medians[choice.name] = benchmark.median(benchmark.time_graph(
                graph, ctx.device, s.benchmark_reps))
            del graph
        else:
            return medians
    medians = {}
    for choice in choices:  # the exchange before each one lines the ranks up
        step = f"time {choice.name}"
        call, state = guarded(choice.run, values)
        with data_plane.bounded(data_timeout(settings), step):
            times = benchmark.time_reps(call, ctx.device, s.benchmark_warmup,
                                        s.benchmark_reps)
        if agree_failures(settings, [choice], {choice.name: state["error"]}, plane, step):
            medians[choice.name] = benchmark.median(times)
    return medians


def worst_medians(settings, choices, values, ctx, plane) -> dict[str, float]:
    """Each choice's median (time_choices), as the timing hook votes where one is set (tests
    and benches force a choice with it), then the slowest rank's: what every rank decides on."""
    medians = time_choices(settings, choices, values, ctx, plane)
    hook = STORE.timing_hook
    if hook is not None:
        medians = agreed(settings, plane, "vote", lambda: hook(dict(medians)))
    gathered = plane.all_gather(medians, "timings") if plane else [medians]
    return {name: max(m.get(name, math.inf) for m in gathered) for name in medians}
