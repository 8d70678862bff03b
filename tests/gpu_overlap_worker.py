"""GPU checks of `ce_overlap` (scheduler/backends/symm_overlap.py), one process per GPU:

    timeout 400 torchrun --nproc-per-node=2 tests/gpu_overlap_worker.py

A TP decoder's backward sites at its training shapes (hidden 4096, Llama-3-8B's widths over the
ranks): the input gradient's all_reduce, its epilogue, and its layer's weight gradient beside it
(gate_up's: 14336 columns a rank at 2 ranks; qkv's: 3072). For each: compile (scratch warm-up),
three eager calls with fresh inputs against the fp32 reference (the weight gradient too), the
reduced outputs bitwise equal across ranks, then CUDA-graph capture (the side stream forked and
joined inside the graph) and replays with new inputs; then the engine on the same site, every
choice timed with the GEMM inside it (native: the GEMM, NCCL, the epilogue in torch), its
timings printed. Prints 'ALL OK' last when everything passed. OVERLAP_HOST_PROFILE=1 adds,
at qkv's shape, the profiler's CPU table and the host and device µs of a call's parts.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("INFINI_DIST_SYMM_TIMEOUT_S", "60")  # a lost peer traps, never hangs

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import infini_dist  # noqa: E402
from gpu_symm_worker import (check, check_replays, report_and_exit, same_everywhere,  # noqa: E402
                             tuned)
from infini_dist.scheduler.choices import RunContext  # noqa: E402
from symm_cases import digest, full_span, max_error, meta_from, reference  # noqa: E402
from test_symm_overlap import PATTERNS  # noqa: E402

HIDDEN = 4096
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3.2e-2}  # the GEMM's sums in another order


def make(graph, tokens, width, dtype, rank, call, device) -> dict:
    """g [tokens, width] (the output gradient: this rank's columns), a [tokens, HIDDEN] (the
    layer's saved input), x this rank's partial input gradient; the epilogue's sides per call."""
    shapes = {"g": (tokens, width), "w": (HIDDEN,)}
    values = {}
    for index, name in enumerate(graph.input_names):
        own = name in ("g", "x")
        gen = torch.Generator().manual_seed(1000 * call + (10 * rank if own else 500) + index)
        t = torch.randn(shapes.get(name, (tokens, HIDDEN)), generator=gen)
        values[name] = (0.5 + t.abs() if name == "w" else t).to(dtype).to(device)
    return values


def reduced(out: dict) -> dict:
    return {n: t for n, t in out.items() if not n.startswith("d")}  # dw: this rank's own


def check_algorithm(ctx, algorithm, pattern, tokens, width, dtype):
    graph = PATTERNS[pattern]
    span = full_span(graph)
    meta = meta_from(graph, make(graph, tokens, width, dtype, 0, 0, "cpu"))
    name = f"{algorithm.name} {pattern} {tokens} x {width} {dtype}"
    check(algorithm.supports(span, meta, ctx), f"{name}: not supported")
    run = algorithm.compile(span, meta, ctx)

    def inputs(call):
        everyone = [make(graph, tokens, width, dtype, r, call, ctx.device)
                    for r in range(ctx.world_size)]
        return everyone, everyone[ctx.rank]

    def expect(everyone):  # on the GPU: fp32 GEMMs (TF32 is off), the partial sums in fp64
        return reference(graph, everyone, ctx.rank)
    for call in range(3):
        everyone, local = inputs(call)
        got = run(local)
        error = max_error(got, expect(everyone))
        check(error <= TOLERANCE[dtype], f"{name} call {call}: error {error:.3g}")
        check(same_everywhere(digest(reduced(got))), f"{name} call {call}: ranks differ")
    host_time(run, local, name)
    if os.environ.get("OVERLAP_HOST_PROFILE") == "1" and tokens == 2048 and width < 8192:
        host_profile(run, local, name)
        host_breakdown(ctx, run, local, tokens, width)
    # check_replays compares every output across ranks; the weight gradients are per rank
    check_replays(lambda env: reduced(run(env)), inputs,
                  lambda everyone: reduced(expect(everyone)), f"graph {name}", dtype,
                  replays=5, tolerance=TOLERANCE[dtype])


def host_time(run, local, name, calls=50):
    """Host µs a call takes to enqueue (no sync inside), and µs a call end to end, eagerly:
    a training step runs these sites without CUDA graphs."""
    import time
    for _ in range(3):
        run(local)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run(local)
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(f"host {name}: {enqueued / calls * 1e6:.1f} us/call enqueued, "
              f"{total / calls * 1e6:.1f} us/call eagerly", flush=True)


def host_profile(run, local, name, calls=30):
    """Where a call's host time goes, rank 0's: the profiler's CPU side (both ranks make the
    calls: the barriers are collective)."""
    for _ in range(3):
        run(local)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run(local)
        torch.cuda.synchronize()
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"host profile {name}, {calls} calls:", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


def host_breakdown(ctx, run, local, tokens, width):
    """Host and device µs of a ce_overlap call's parts, each alone (qkv's backward shape)."""
    prepared = run.prepared
    g = local["g"]
    a = next(v for n, v in local.items() if n not in ("g", "w", "x"))
    p = local["x"]
    targets, source = prepared.targets, p.view(-1)
    side = torch.cuda.Stream()
    caller = torch.cuda.current_stream()
    out = torch.empty_like(p)
    per_call = [p.view(prepared.plan.tail.shape)] + [local[n] for n in prepared.names[1:]] \
        + [out, torch.empty(p.shape[:-1] + (1,), device=p.device)][:len(prepared.plan.tail.writes)]

    def mm():
        torch.mm(g.t(), a)

    def copy():
        for t in targets:
            t.copy_(source)

    def forked(aside=(), beside=()):
        """torch's fork and join of the side stream (CopyEngineOverlap.run's), `aside` run on
        the side stream, `beside` on the caller's."""
        def call():
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                for fn in aside:
                    fn()
                done = side.record_event()
            for fn in beside:
                fn()
            caller.wait_event(done)
        return call

    def reduce_only():
        for launch in prepared.launches:
            launch(*per_call)

    def copy_reduce():
        copy()
        reduce_only()

    def mm_copy_reduce():
        mm()
        copy()
        reduce_only()
    parts = {"mm": mm, "copy": copy, "fork+join": forked(), "fork+copy+join": forked([copy]),
             "fork+copy+mm+join": forked([copy], [mm]), "reduce launches": reduce_only,
             "copy+reduce (one stream)": copy_reduce, "mm+copy+reduce (one stream)":
             mm_copy_reduce, "the whole call": lambda: run(local),
             "empty_like": lambda: torch.empty_like(p)}
    # host: issuing the calls while a sleep kernel holds the GPU (no launch waits for room in
    # the queue); device: the same calls' GPU time behind it; max over ranks
    from infini_dist.launch.bench_eager import host_device_loop
    rows = {name: host_device_loop(fn, calls=40, rounds=1)[:2] for name, fn in parts.items()}
    if dist.get_rank() == 0:
        for name, (host, device) in rows.items():
            print(f"host breakdown {tokens} x {width}: {name:30s} host {host:7.1f} us, "
                  f"device {device:7.1f} us", flush=True)


def copy_host_time(ctx, mib=16, calls=20):
    """Host µs to enqueue a bare copy into the peer's symmetric buffer, against its GPU µs (a
    ce_overlap call's host time is far more: 150-300 µs on 2 H100s, session 21)."""
    import time
    from infini_dist.kernels import symm_buffers
    buffer = symm_buffers.get_buffer(ctx.group, ctx.device, "copy_probe", 2 * mib << 20)
    numel = mib << 19
    peer = (ctx.rank + 1) % ctx.world_size
    target = symm_buffers.data_view(buffer, peer, torch.bfloat16, 0, numel)
    source = torch.randn(numel, device=ctx.device).to(torch.bfloat16)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        target.copy_(source)
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"host copy {mib} MiB to the peer: {enqueued / calls * 1e6:.1f} us "
              f"enqueued, {total / calls * 1e6:.1f} us a copy", flush=True)


def check_engine(ctx, pattern, tokens, width, dtype=torch.bfloat16):
    graph = PATTERNS[pattern]
    everyone = [make(graph, tokens, width, dtype, r, 7, ctx.device) for r in range(ctx.world_size)]
    got, record = tuned(graph, everyone[ctx.rank], f"{pattern} {tokens} x {width}")
    check(sum(c.startswith("ce_overlap") for c in record["candidates"]) >= 2,
          f"engine {pattern}: ce_overlap did not survive: {record['candidates']}")
    error = max_error(got, reference(graph, everyone, ctx.rank))
    check(error <= TOLERANCE[dtype], f"engine {pattern} {tokens}: error {error:.3g}")


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    infini_dist.config.custom_op_fusion_types = ("epilogue", "prologue", "cross_subgraph",
                                                 "overlap")
    ctx = RunContext(None, dist.get_world_size(), dist.get_rank(), torch.device("cuda", rank),
                     settings=infini_dist.config.snapshot())
    gate_up, qkv = 2 * 14336 // ctx.world_size, (32 + 2 * 8) * 128 // ctx.world_size
    from infini_dist.scheduler.backends.symm_overlap import algorithms
    copy_host_time(ctx)
    for algorithm in algorithms():
        check_algorithm(ctx, algorithm, "one_gemm_mul", 2048, qkv, torch.bfloat16)
        check_algorithm(ctx, algorithm, "two_gemms_norm", 512, 1024, torch.float32)
        check_algorithm(ctx, algorithm, "one_gemm_mul", 2048, gate_up, torch.bfloat16)
    for tokens in map(int, os.environ.get("OVERLAP_ENGINE_TOKENS", "2048,8192").split(",")):
        for width in (gate_up, qkv):
            check_engine(ctx, "one_gemm_mul", tokens, width)
    report_and_exit()


if __name__ == "__main__":
    main()
