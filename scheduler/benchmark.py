"""Timing one choice on one rank: warm-up, then repetitions timed one by one.

CUDA events on GPU (device time, no host sync inside the loop), over CUDA-graph replays where
the choice can be captured; perf_counter on CPU. The engine
calls this in lockstep on every rank and combines the medians by MAX, since a collective is as
slow as its slowest rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_reps(fn: Callable[[], object], device: torch.device, warmup: int,
              reps: int) -> list[float]:
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


CALLS_PER_GRAPH = 10  # one replay holds several calls, so the replay launch itself is amortised


def capture(fn: Callable[[], object], device: torch.device, warmup: int):
    """(graph of CALLS_PER_GRAPH calls, None), or (None, reason) if fn cannot be captured.
    Capture only records work: nothing crosses ranks here, so a local failure is safe."""
    try:
        for _ in range(max(1, warmup)):
            fn()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                fn()
        return graph, None
    except Exception as error:  # noqa: BLE001 - reported and agreed on by the caller
        torch.cuda.synchronize(device)
        return None, f"{type(error).__name__}: {error}"


def time_graph(graph, device: torch.device, reps: int) -> list[float]:
    """Seconds per call, from `reps` replays of a captured graph (after one untimed replay)."""
    return [t / CALLS_PER_GRAPH for t in time_reps(graph.replay, device, 1, reps)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def pick(times: dict[str, float], native: str, native_like: set[str], threshold: float) -> str:
    """The committed choice: `native` unless another choice beats it by `threshold`
    (times[native] / times[other] >= threshold). A choice that fuses ops (not in `native_like`)
    must also beat the fastest qualifying native-like one by `threshold`. Among what qualifies
    the fastest wins; ties go to native, then to the smaller name."""
    def beats(name: str, base: str) -> bool:
        return times[base] >= times[name] * threshold

    ranked = sorted(times, key=lambda name: (times[name], name != native, name))
    plain = next(n for n in ranked if n == native or (n in native_like and beats(n, native)))
    fused = [n for n in ranked if n != native and n not in native_like]
    return next(n for n in ranked if n == plain or (n in fused and beats(n, plain)))
