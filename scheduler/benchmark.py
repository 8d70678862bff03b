"""Timing one choice on one rank: warm-up, then repetitions timed one by one.

CUDA events on GPU (device time, no host sync inside the loop), perf_counter on CPU. The engine
calls this in lockstep on every rank and combines the medians by MAX, since a collective is as
slow as its slowest rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_reps(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds per repetition."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def pick(times: dict[str, float], unfused: set[str], threshold: float) -> str:
    """Argmin, ties broken by name. A fused choice must beat the best unfused one by `threshold`
    (best_unfused / fused >= threshold) or the best unfused one is kept."""
    ranked = sorted(times, key=lambda name: (times[name], name))
    best = ranked[0]
    unfused_ranked = [n for n in ranked if n in unfused]
    if best in unfused or not unfused_ranked:
        return best
    best_unfused = unfused_ranked[0]
    if times[best_unfused] >= times[best] * threshold:
        return best
    return best_unfused
