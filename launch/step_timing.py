"""Step timing that keeps the host apart from the GPU (`bench --hf`), for variants that bring
their own CUDA graphs (torch.compile mode="reduce-overhead").

A single median of calls timed one variant after the other mixes three things: the GPU's work,
the host's (Dynamo guards, the cudagraph-tree launch path), and whatever else the machine did
during that variant's turn. Here the variants are timed in interleaved rounds (plain, ours,
ours, plain, ...: the order flips every round), and per variant we keep:

  call_us      CUDA events around each call, no host sync in the loop (what a decode loop sees;
               the GPU waits for the host where the host is slower); median of every call of
               every round, with p10 / p90 and the spread of the round medians
  host_us      time for the call to return on the host (no sync): the host's cost per step
  wall_us      a round's wall time per call, synchronised at its end
  graphs       how many recorded graphs one step launches (a site that split the step's
               graph would show here as more graphs for ours than for plain)

`time_device` times the same calls as the device alone makes them: each round queues its calls
behind a sleep kernel long enough for the host to issue them all before the device starts, so
the round's span on the device is the steps back to back with no host in the way (the GPU's own
step, gaps between its kernels included). A host-bound decode loop hides what a site saves; this
shows it.

Every number is max over ranks. `profile_step` adds a torch.profiler view of a few steps: the
GPU's kernel time per step (its busy time, with no host in the way), graph launches, and the
host ops that cost the most. (Replaying a tree's recorded graphs directly would time the GPU
alone too, but is wrong: Inductor frees a graph's input buffer inside the graph once read, and
only the tree's own run copies the input back in; replays read garbage token ids.)
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from infini_dist.launch.model_report import cell


def step_graphs(device) -> list:
    """The CUDAGraphs the latest step ran, first to last (a step starts at the tree's root:
    callers mark every step begin); [] without cudagraph trees or where torch's private
    layout is not the one expected."""
    try:
        from torch._inductor import cudagraph_trees
        manager = cudagraph_trees.get_manager(device.index, create_if_none_exists=False)
        node = getattr(manager, "current_node", None)
        if not isinstance(node, cudagraph_trees.CUDAGraphNode):
            return []
        return [n.graph for n in node._path_from_root if n.graph is not None]
    except (ImportError, AttributeError, TypeError):
        return []


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_round(fn, calls: int, cuda: bool) -> tuple[list[float], list[float], float]:
    """(event us per call, host us per call, wall us per step) over `calls` back-to-back calls."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)] if cuda else []
    host = []
    begin = time.perf_counter()
    for i in range(calls):
        if cuda:
            events[i][0].record()
        start = time.perf_counter()
        fn()
        host.append((time.perf_counter() - start) * 1e6)
        if cuda:
            events[i][1].record()
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - begin) * 1e6 / calls
    timed = [s.elapsed_time(e) * 1e3 for s, e in events] if cuda else host
    return timed, host, wall


def time_interleaved(bench, calls: dict, rounds: int, per_round: int) -> dict:
    """name -> timing fields (see the module doc) for each call in `calls`, max over ranks.

    Every rank runs the same rounds in the same order; a gloo barrier starts each turn, so the
    ranks enter a variant together and the collectives inside do not time the other rank's
    lateness from the previous turn."""
    names = list(calls)
    timed = {n: [] for n in names}
    host = {n: [] for n in names}
    walls = {n: [] for n in names}
    round_medians = {n: [] for n in names}
    graphs = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier(group=bench.control)
            t, h, w = _time_round(calls[name], per_round, bench.cuda)
            timed[name] += t
            host[name] += h
            walls[name].append(w)
            round_medians[name].append(statistics.median(t))
    for name in names:
        if bench.cuda:  # one more step of the name's own: the tree's path is that step's
            calls[name]()
            torch.cuda.synchronize()
            graphs[name] = len(step_graphs(bench.device))
    result = {}
    for name in names:
        fields = {
            "call_us": statistics.median(timed[name]),
            "call_p10_us": _percentile(timed[name], 0.1),
            "call_p90_us": _percentile(timed[name], 0.9),
            "round_spread": max(round_medians[name]) / min(round_medians[name]),
            "host_us": statistics.median(host[name]),
            "wall_us": statistics.median(walls[name]),
        }
        result[name] = {k: bench.worst(v) for k, v in fields.items()}
        if name in graphs:
            result[name]["graphs_per_step"] = int(bench.worst(graphs[name]))
        result[name]["samples"] = len(timed[name])
    return result


def sleep_cycles_for(seconds: float, device) -> tuple:
    """torch.cuda._sleep's cycle count for about `seconds`, and what it then takes (the median
    of 5 timed sleeps; the clock is the device's, so it is measured, not computed)."""
    def timed(cycles: int) -> float:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        runs = []
        for _ in range(5):
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(runs)
    probe = 1_000_000
    cycles = max(1, round(probe * seconds / timed(probe)))
    return cycles, timed(cycles)


def _device_round(fn, calls: int, cycles: int, align) -> tuple[float, bool]:
    """(device us per call, whether the host issued every call before the device began them)."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    align()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    ahead = not start.query()  # the sleep (or the alignment) still held the device back
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls, ahead


def time_device(bench, calls: dict, rounds: int, per_round: int, host_us: dict) -> dict:
    """name -> {device_us: the median round's device time per call, device_spread: the
    spread of the round medians, device_rounds: rounds timed, device_rounds_behind: rounds
    where the host had not issued every call before the device began (their time is the
    host's too: the round is tried again behind a sleep twice as long, up to 4x the first, three
    tries a round; a variant whose three tries all fall behind waits for the device inside its
    calls, and is not tried again)}, max over ranks. `host_us`: each call's host time, which
    sizes the sleep. Interleaved as in `time_interleaved`. After each rank's sleep a
    one-element all_reduce on the default group lines the devices up, so that no rank's span
    includes waiting for a peer's later start."""
    names = list(calls)
    marker = torch.zeros(1, device=bench.device)

    def align():
        if dist.get_world_size() > 1:
            dist.all_reduce(marker)
    align()  # a first collective builds its communicator: seconds of host time, not in a round
    torch.cuda.synchronize()
    cycles, seconds = sleep_cycles_for(0.002, bench.device)  # the device's clock, measured once
    sleeps = {name: round(cycles / seconds * (1.5 * per_round * host_us[name] * 1e-6 + 0.002))
              for name in names}
    longest = {n: 4 * s for n, s in sleeps.items()}
    per_call = {n: [] for n in names}
    behind = {n: 0 for n in names}
    waits = set()  # variants whose calls wait for the device: no sleep gets the host ahead
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name in waits:
                continue
            for _ in range(3):
                dist.barrier(group=bench.control)
                us, ahead = _device_round(calls[name], per_round, sleeps[name], align)
                # every rank must agree, or one repeats a round its peers do not
                ahead = bench.worst(0.0 if ahead else 1.0) == 0.0
                if ahead:
                    per_call[name].append(us)
                    break
                behind[name] += 1
                sleeps[name] = min(2 * sleeps[name], longest[name])
            else:
                waits.add(name)
    result = {}
    for name in names:
        timed = per_call[name]
        result[name] = {
            "device_us": bench.worst(statistics.median(timed)) if timed else None,
            "device_spread": bench.worst(max(timed) / min(timed)) if timed else None,
            "device_rounds": len(timed), "device_rounds_behind": behind[name]}
    return result


def profile_step(fn, steps: int, cuda: bool, trace_path: str | None = None) -> dict:
    """A torch.profiler view of `steps` calls: per step, the host time of the call, the GPU
    kernel time, graph launches, our op's host calls; and the 8 host ops with the most self
    time. This rank only."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            fn()
        host = (time.perf_counter() - begin) * 1e6 / steps
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()

    def count(name: str) -> float:  # the CUDA runtime's names may carry a version suffix
        return sum(e.count for e in averages if e.key.startswith(name)) / steps
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in averages
                    if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return {"host_us_per_step": host, "gpu_kernel_us_per_step": kernel_us / steps,
            "graph_launches_per_step": count("cudaGraphLaunch"),
            "fused_site_host_calls_per_step": count("infini_dist::fused_site"),
            "top_host_ops": [(e.key[:60], e.self_cpu_time_total / steps, e.count / steps)
                             for e in top]}


def timing_lines(rows: list[dict], shapes) -> list[str]:
    """The interleaved timings of the compiled variants, one line per shape and variant, and
    each profiled step's view."""
    lines = ["", "interleaved timing (us per step, max over ranks): call = events around each "
             "call (p10-p90, spread of round medians), host = call returns, wall = per call "
             "with a sync per round, kernels = GPU kernel time per step (profiler, rank 0), "
             "device = the step as the device alone makes it (time_device; spread of its "
             "rounds)",
             f"{'shape':>14s} {'variant':15s} {'call':>8s} {'p10-p90':>15s} {'spread':>6s} "
             f"{'host':>8s} {'wall':>8s} {'kernels':>8s} {'graphs':>6s} {'device':>8s} "
             f"{'spread':>6s}"]
    for shape in shapes:
        for row in rows:
            if row["shape"] != shape.name or "call_us" not in row:
                continue
            gpu = row.get("profile", {}).get("gpu_kernel_us_per_step")
            lines.append(
                f"{shape.name:>14s} {row['variant']:15s} {row['call_us']:8.1f} "
                f"{row['call_p10_us']:7.1f}-{row['call_p90_us']:<7.1f} "
                f"{row['round_spread']:6.2f} {row['host_us']:8.1f} {row['wall_us']:8.1f} "
                f"{'-' if gpu is None else f'{gpu:.1f}':>8s} "
                f"{row.get('graphs_per_step', '-')!s:>6s} {cell(row, 'device_us', '.1f'):>8s} "
                f"{cell(row, 'device_spread', '.2f'):>6s}")
    for row in rows:
        view = row.get("profile")
        if view:
            lines.append(f"profile {row['shape']} {row['variant']} (rank 0, per step): host "
                         f"{view['host_us_per_step']:.1f} us, GPU kernels "
                         f"{view['gpu_kernel_us_per_step']:.1f} us, graph launches "
                         f"{view['graph_launches_per_step']:g}, fused_site host calls "
                         f"{view['fused_site_host_calls_per_step']:g}; top host ops: " +
                         "; ".join(f"{k} {us:.0f}us x{n:g}" for k, us, n in view["top_host_ops"]))
    return lines
