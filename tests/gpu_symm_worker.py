"""GPU checks of the symmetric-memory kernels, one process per GPU:

    timeout 300 torchrun --standalone --nproc-per-node=2 tests/gpu_symm_worker.py [--quick]
        [--only NAME|engine]

Per kernel, pattern, shape and dtype: compile (scratch warm-up), three eager calls with fresh
inputs against the unfused reference, bitwise equality across ranks; then CUDA-graph capture and
replays with new inputs, back-to-back launches of different grids on one buffer, the kernel as
a plain callable (symm_call.SymmKernel), and the engine end to end. Prints 'ALL OK' last when everything passed; exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

# A lost peer traps, never hangs; read into infini_dist.config.symm_timeout_s on import.
os.environ.setdefault("INFINI_DIST_SYMM_TIMEOUT_S", "60")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from symm_cases import (PATTERNS, RSTD_TOLERANCE, TRAIN, build, digest,  # noqa: E402
                        full_span, make_inputs, max_error, meta_of, reference, rstd_error)

import infini_dist  # noqa: E402
from infini_dist.kernels import symm_buffers  # noqa: E402
from infini_dist.scheduler.backends.symm_launch import tuning_of  # noqa: E402
from infini_dist.scheduler.choices import RunContext  # noqa: E402
from symm_runs import CALLABLE_CASES, by_callable, symm_algorithms  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 4e-3}
failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print(f"[rank {dist.get_rank()}] FAIL {message}", flush=True)


def same_everywhere(value) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return len(set(values)) == 1


def compiled(algorithm, pattern, shape, dtype, ctx):
    graph = build(pattern)
    span = full_span(graph)
    meta = meta_of(graph, shape, dtype)
    assert algorithm.supports(span, meta, ctx), (algorithm.name, pattern, shape)
    return graph, algorithm.compile(span, meta, ctx)


def largest_supported(algorithm, pattern, shape, dtype, ctx, floor=1024):
    """`shape`, its tokens halved until `algorithm` takes it, never below `floor`: a buffer
    that grows with the world size (one-shot's W slots) caps the tokens lower on more ranks."""
    tokens, hidden = shape
    graph = build(pattern)
    while tokens > floor and not algorithm.supports(
            full_span(graph), meta_of(graph, (tokens, hidden), dtype), ctx):
        tokens //= 2
    return tokens, hidden


def inputs_for(graph, shape, dtype, call, world_size, rank, device):
    everyone = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
    return everyone, {n: t.to(device) for n, t in everyone[rank].items()}


def check_eager(algorithm, pattern, shape, dtype, ctx):
    graph, run = compiled(algorithm, pattern, shape, dtype, ctx)
    for call in range(3):
        everyone, local = inputs_for(graph, shape, dtype, call, ctx.world_size, ctx.rank,
                                     ctx.device)
        got = run(local)
        error = max_error(got, reference(graph, everyone, ctx.rank))
        name = f"{algorithm.name} {pattern} {shape} {dtype} call {call}"
        check(error <= TOLERANCE[dtype], f"{name}: error {error:.3g}")
        rstd = rstd_error(graph, got, local)  # the rsqrt the norm used
        check(rstd <= RSTD_TOLERANCE, f"{name}: rstd error {rstd:.3g}")
        check(same_everywhere(digest(got)), f"{name}: ranks differ")


def check_callable(algorithm, ctx, shape=(7, 4096), dtype=torch.bfloat16):
    """The kernel as a plain callable, on its own symmetric buffer of the world group."""
    for pattern in CALLABLE_CASES:
        graph = build(pattern)
        for call in range(2):
            everyone, local = inputs_for(graph, shape, dtype, call, ctx.world_size, ctx.rank,
                                         ctx.device)
            got = by_callable(algorithm.kernel, pattern, local, tuning=tuning_of(ctx.settings))
            error = max_error(got, reference(graph, everyone, ctx.rank))
            name = f"callable {algorithm.name} {pattern} call {call}"
            check(error <= TOLERANCE[dtype], f"{name}: error {error:.3g}")
            check(same_everywhere(digest(got)), f"{name}: ranks differ")


def check_graph_replay(algorithm, pattern, shape, dtype, ctx, replays=20):
    graph, run = compiled(algorithm, pattern, shape, dtype, ctx)
    check_replays(run, lambda call: inputs_for(graph, shape, dtype, call, ctx.world_size,
                                               ctx.rank, ctx.device),
                  lambda everyone: reference(graph, everyone, ctx.rank),
                  f"graph {algorithm.name} {pattern} {shape} {dtype}", dtype, replays)


def check_replays(run, inputs_of, expect, name, dtype, replays=20, tolerance=None):
    """`run` captured in a CUDA graph after an eager call on inputs_of(0) (everyone's inputs,
    this rank's), then replayed with inputs_of(1..3) copied in: each output against
    expect(everyone's inputs) and the same on every rank."""
    _, static = inputs_of(0)
    run(static)  # eager first: the rendezvous happens here, never under capture
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        out = run(static)
    for call in range(1, 4):
        everyone, local = inputs_of(call)
        for key, t in local.items():
            static[key].copy_(t)
        for _ in range(replays if call == 1 else 1):  # many replays: halves and flags cycle
            cuda_graph.replay()
        error = max_error(out, expect(everyone))
        check(error <= (tolerance or TOLERANCE[dtype]), f"{name} replay {call}: error {error:.3g}")
        check(same_everywhere(digest(out)), f"{name} replay {call}: ranks differ")


def check_mixed_grids(algorithm, ctx, dtype=torch.bfloat16):
    """Launches of different grids back to back on one buffer, no host sync in between."""
    shapes = [(1, 4096), (300, 4096), (3, 4096), (129, 4096), (2, 4096)]
    runs = [compiled(algorithm, "add_rms_norm", s, dtype, ctx) for s in shapes]
    pending = []
    for shape, (graph, run) in zip(shapes, runs):
        everyone, local = inputs_for(graph, shape, dtype, 7, ctx.world_size, ctx.rank,
                                     ctx.device)
        pending.append((shape, graph, everyone, run(local)))
    for shape, graph, everyone, got in pending:
        error = max_error(got, reference(graph, everyone, ctx.rank))
        check(error <= TOLERANCE[dtype], f"mixed {algorithm.name} {shape}: error {error:.3g}")


def tuned(graph, local, label):
    """`graph` run by the engine on this rank's inputs `local` (tuned across the ranks at the
    first call): its outputs and the tuning record, whose timings rank 0 prints."""
    from infini_dist.scheduler.engine import executor_for
    executor = executor_for(graph, infini_dist.config.snapshot())
    got = executor.run(local)
    record = executor.site_runners()[0].last_tuning
    if dist.get_rank() == 0:
        times = ", ".join(f"{n}={t * 1e6:.1f}us" for n, t in sorted(
            record["times_s"].items(), key=lambda kv: kv[1]))
        print(f"engine {label}: committed {record['choice']} ({times})", flush=True)
    return got, record


def check_engine(ctx, dtype=torch.bfloat16):
    from infini_dist.scheduler.boundary import find_sites
    for pattern, shape in (("add_rms_norm", (16, 4096)), ("relu_scale", (1, 4096)),
                           (TRAIN, (2048, 4096))):
        graph = build(pattern)
        everyone, local = inputs_for(graph, shape, dtype, 3, ctx.world_size, ctx.rank,
                                     ctx.device)
        got, record = tuned(graph, local, f"{pattern} {shape}")
        check(any(c.startswith(("one_shot", "two_shot")) for c in record["candidates"]),
              f"engine {pattern}: no symm candidate survived: {record['candidates']}")
        # The whole site in one launch (a training forward's too: rsqrt and reduced value).
        full = f",e{len(find_sites(graph)[0].epilogue)}]"
        check(any(c.startswith(tuple(symm_algorithms())) and c.endswith(full)
                  for c in record["candidates"]),
              f"engine {pattern}: no full-depth symm candidate: {record['candidates']}")
        error = max_error(got, reference(graph, everyone, ctx.rank))
        check(error <= TOLERANCE[dtype], f"engine {pattern}: error {error:.3g}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", help="one registered symm algorithm by name, or 'engine'")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    ctx = RunContext(None, dist.get_world_size(), dist.get_rank(), torch.device("cuda", rank),
                     settings=infini_dist.config.snapshot())
    registered = symm_algorithms()
    if args.only not in (None, "engine", *registered):
        raise SystemExit(f"--only {args.only}: registered are {sorted(registered)}")
    algorithms = [a for name, a in sorted(registered.items()) if args.only in (None, name)]
    big = {"two_shot": (8192, 4096), "two_shot_lamport": (1024, 4096),
           "two_shot_polled_gather": (8192, 4096), "one_shot_lamport_streamed": (8192, 4096)}
    shapes = [(1, 4096), (7, 4096), (3, 4095)] if args.quick else \
        [(1, 4096), (7, 4096), (128, 4096), (3, 4095), (5, 200), (1000, 1024)]
    for algorithm in algorithms:
        for pattern in PATTERNS:
            for shape in shapes:
                check_eager(algorithm, pattern, shape, torch.bfloat16, ctx)
        for dtype in (torch.float32, torch.float16):
            check_eager(algorithm, "prologue_norm", (9, 512), dtype, ctx)
            check_eager(algorithm, "plain", (1, 333), dtype, ctx)
        check_eager(algorithm, "add_rms_norm", (200, 4096), torch.bfloat16, ctx)  # > programs
        for pattern in ("add_rms_norm", TRAIN, "swiglu", "prologue_gelu"):
            check_graph_replay(algorithm, pattern, (16, 4096), torch.bfloat16, ctx)
        check_mixed_grids(algorithm, ctx)
        check_callable(algorithm, ctx)
    for algorithm in algorithms:
        for pattern in ("add_rms_norm", TRAIN) if algorithm.name in big else ():
            shape = largest_supported(algorithm, pattern, big[algorithm.name], torch.bfloat16,
                                      ctx)
            check_eager(algorithm, pattern, shape, torch.bfloat16, ctx)
    if args.only in (None, "engine"):
        check_engine(ctx)
    two_shot = registered["two_shot"]
    if two_shot in algorithms:
        # Last, since a failure traps the process: two-shot in rounds (phase 3 of a round
        # beside phase 2 of the next), rows and chunks.
        rounds = dataclasses.replace(
            ctx, settings=dataclasses.replace(ctx.settings, symm_round_items=4))
        check_eager(two_shot, "add_rms_norm", (1000, 1024), torch.bfloat16, rounds)
        check_eager(two_shot, "relu_scale", (2048, 4096), torch.bfloat16, rounds)
        check_graph_replay(two_shot, "add_rms_norm", (1000, 1024), torch.bfloat16, rounds)
    if rank == 0:
        print("buffers:", symm_buffers.cached_buffers(), flush=True)
    report_and_exit()


def report_and_exit():
    """'ALL OK' on rank 0 where every check passed on every rank; the exit status says it."""
    ok = same_everywhere(not failures) and not failures
    dist.barrier()
    if dist.get_rank() == 0:
        print("ALL OK" if ok else f"FAILED ({len(failures)} on rank 0)", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
