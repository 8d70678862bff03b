"""Latency sweep of all_reduce + epilogue: our engine and its candidates against the peers.

    torchrun --nproc-per-node=4 -m infini_dist.launch.bench --out bench_out \\
        [--tokens 1,16,128,1024,8192] [--hidden 4096]
        [--patterns add_rms_norm,add_rms_norm_fp8,add_rms_norm_fp8_tensor,add_rms_norm_fp8_token,
                   relu_scale,swiglu]

Per pattern and token count, every implementation is timed under CUDA-graph replay and eagerly,
in this one run, max over ranks (a collective is as slow as its slowest rank):
  nccl_ar           NCCL all_reduce alone, in place (the floor; its values grow, which NCCL
                    does not care about)
  native            the user's own eager path: NCCL all_reduce of a copy + the epilogue in
                    eager torch (what the engine must never be slower than)
  native_inductor   the engine's native choice for a compiled site: NCCL all_reduce + the
                    epilogue compiled by Inductor (GPU; one compile per case)
  compile           torch.compile of funcol.all_reduce + the epilogue
  symm_one_shot     torch.ops.symm_mem.one_shot_all_reduce_copy + eager epilogue
  symm_two_shot     copy into a symmetric tensor + two_shot_all_reduce_ + eager epilogue
  symm_*_ar         torch's symmetric-memory all-reduces alone, on the symmetric tensor (with
                    nccl_ar and the NCCL-symmetric peer's nccl_symm_ar, the all-reduces the
                    fused op is held against: `engine / the fastest all-reduce alone`)
  cand:<choice>     every choice the engine generates for the site (cand:native included)
  engine            executor_for(graph, settings).run(...): the engine's committed choice
  fi_*              FlashInfer's trtllm all-reduce (+ fusion) kernels, when it is installed
                    (launch/peers_flashinfer.py)
  nccl_symm*        NCCL's symmetric kernels (launch/peers_nccl_symm.py), timed by a process of
                    their own in the same call and merged with --extra-rows
Writes a table on stdout, results.json and latency.png under --out, and lists every case where
the engine row is above the native row by more than --noise. With --cpu-smoke it runs on gloo
CPU ranks (no graphs, no symmetric memory) to check the script itself.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import infini_dist
from infini_dist.scheduler.benchmark import CALLS_PER_GRAPH
from infini_dist.scheduler.choices import RunContext, native_choice
from infini_dist.scheduler.engine import executor_for
from infini_dist.launch import shutdown
from infini_dist.launch.arguments import (names, nonempty_ints, nonnegative_float, parse,
                                          positive_int)
from infini_dist.launch.bench_patterns import (EPS, FP8_SCALE, PATTERNS, dequantized,
                                               eager_epilogue, make_inputs, pattern_graph)
from infini_dist.launch.bench_targets import (above_native, engine_vs_ar_alone,
                                              engine_vs_flashinfer, extra_rows, fp8_cost)
from infini_dist.launch.peers_flashinfer import open_peers as open_flashinfer

class Timer:
    """`graph_calls`: calls captured in each CUDA graph; a replay's time is divided by it. One
    call a graph adds the gap between graph launches to every call (about 1 µs on H100, a
    fifth of a one-token call); a decode graph runs many ops back to back, and the engine's
    tuning captures CALLS_PER_GRAPH (10) a graph, the sweep's default too."""

    def __init__(self, device, trials, replays, graph_calls: int = 1):
        self.device, self.trials, self.replays = device, trials, replays
        self.graph_calls = graph_calls
        self.cuda = device.type == "cuda"

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def _measure(self, body, reset) -> float:
        samples = []
        for _ in range(self.trials):
            reset()
            self._sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(self.replays):
                    body()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / self.replays)
            else:
                begin = time.perf_counter()
                for _ in range(self.replays):
                    body()
                samples.append((time.perf_counter() - begin) / self.replays)
        mine = torch.tensor([statistics.median(samples)], dtype=torch.float64,
                            device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine.item())

    def eager(self, fn, reset=lambda: None) -> float:
        fn()
        fn()
        return self._measure(fn, reset)

    def rows(self, impls, pattern, tokens, eager=True) -> list[dict]:
        """One row per implementation (name -> (callable, reset)), µs in graph replay and
        eagerly; an implementation that fails gets its error in the row instead."""
        rows = []
        for name, (fn, reset) in impls.items():
            row = {"pattern": pattern, "tokens": tokens, "impl": name}
            for mode in ("graph", "eager") if eager else ("graph",):
                try:
                    seconds = self.graph(fn, reset) if mode == "graph" else self.eager(fn, reset)
                    row[f"{mode}_us"] = None if seconds is None else seconds * 1e6
                except Exception as err:  # noqa: BLE001 - one failing peer must not stop a sweep
                    row[f"{mode}_error"] = f"{type(err).__name__}: {err}"[:300]
                    torch.cuda.synchronize() if self.cuda else None
            rows.append(row)
        return rows

    def capture(self, fn, calls: int) -> torch.cuda.CUDAGraph:
        """A CUDA graph of `calls` calls of fn, after an eager call and a warm-up one."""
        fn()  # eager first: lazy setup (rendezvous, compilation) never runs under capture
        self._sync()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(calls):
                fn()
        return cuda_graph

    def graph(self, fn, reset=lambda: None) -> float | None:
        if not self.cuda:
            return None
        cuda_graph = self.capture(fn, self.graph_calls)
        try:
            return self._measure(cuda_graph.replay, reset) / self.graph_calls
        finally:
            del cuda_graph


_COMPILED = {}


def peers(pattern, inputs, group, cuda, compile_peer):
    """name -> callable running one all_reduce + epilogue of this pattern (with a reset)."""
    x = inputs["x"]
    impls = {}
    floor = x.clone()
    impls["nccl_ar"] = (lambda: dist.all_reduce(floor, group=group), lambda: floor.copy_(x))

    def native():
        y = x.clone()
        dist.all_reduce(y, group=group)
        return eager_epilogue(pattern, y, inputs)
    impls["native"] = (native, lambda: None)
    if not cuda:
        return impls
    group_name = (group or dist.group.WORLD).group_name
    if compile_peer:
        import torch.distributed._functional_collectives as funcol

        def traced(x, sides):
            return eager_epilogue(pattern, funcol.all_reduce(x, "sum", group_name), sides)
        # One compile per pattern, shape-generic: a compile per token count costs minutes.
        compiled_fn = _COMPILED.setdefault(pattern, torch.compile(traced, dynamic=True))
        sides = {k: v for k, v in inputs.items() if k != "x"}
        impls["compile"] = (lambda: compiled_fn(x, sides), lambda: None)
    import torch.distributed._symmetric_memory as symm_mem
    symm = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(symm, group_name)
    if hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        def one_shot():
            y = torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x, "sum", group_name)
            return eager_epilogue(pattern, y, inputs)
        impls["symm_one_shot"] = (one_shot, lambda: None)

    # The fastest all-reduces that do no epilogue (issue #25: the fused op must not be slower)
    impls["symm_two_shot_ar"] = (
        lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name),
        lambda: symm.copy_(x))
    if hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        impls["symm_one_shot_ar"] = (
            lambda: torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", group_name),
            lambda: symm.copy_(x))

    def two_shot():
        symm.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name)
        return eager_epilogue(pattern, symm, inputs)
    impls["symm_two_shot"] = (two_shot, lambda: None)
    return impls


def engine_candidates(graph, inputs, group, device, native_inductor=False):
    """The engine's choices for the site of `graph`, precompiled, by name (with the native
    choice of a compiled site as `native_inductor`)."""
    settings = infini_dist.config.snapshot()
    executor = executor_for(graph, settings)
    ctx = RunContext(group, dist.get_world_size(group), dist.get_rank(group), device,
                     settings=settings)
    runner = executor.site_runners()[0]
    choices, meta, _ = runner.candidates(dict(inputs), ctx)
    named = [(f"cand:{c.name}", c) for c in choices]
    if native_inductor:
        named.append(("native_inductor", native_choice(graph, runner.site, compiled=True)))
    out = {}
    for name, choice in named:
        try:
            choice.precompile(meta, ctx)
            out[name] = (lambda c=choice: c.run(inputs), lambda: None)
        except Exception as error:  # noqa: BLE001 - report and go on; the engine drops it too
            if dist.get_rank() == 0:
                print(f"  candidate {choice.name} failed to compile: {error}", flush=True)
    return executor, out


def run_case(args, pattern, tokens, device, group, timer, flashinfer=None):
    dtype = getattr(torch, args.dtype)
    inputs = make_inputs(pattern, tokens, args.hidden, dtype, device, dist.get_rank())
    graph = pattern_graph(pattern)
    impls = peers(pattern, inputs, group, device.type == "cuda", args.compile_peer)
    if flashinfer is not None:
        impls.update(flashinfer.peers(pattern, inputs,
                                      lambda y, sides: eager_epilogue(pattern, y, sides), EPS,
                                      FP8_SCALE, (lambda outs: dequantized(pattern, outs))
                                      if "fp8" in pattern else None))
    executor, candidates = engine_candidates(graph, inputs, group, device,
                                             device.type == "cuda" and args.native_inductor)
    # The engine decides on its first (eager) call, in lockstep on all ranks.
    reference = executor.run(inputs, group)
    record = getattr(executor.site_runners()[0], "last_tuning", None) or {}
    impls.update(candidates)
    impls["engine"] = (lambda: executor.run(inputs, group), lambda: None)
    expected = impls["native"][0]()
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = tuple(reference[name] for name in graph.output_names)
    error = float((dequantized(pattern, got)[0].float()
                   - dequantized(pattern, expected)[0].float()).abs().max())
    rows = timer.rows(impls, pattern, tokens, eager=not args.no_eager)
    return rows, {"committed": record.get("choice"), "engine_vs_native_max_abs": error,
                  "tuning_times_us": {k: v * 1e6 for k, v in record.get("times_s", {}).items()}}


def print_table(rows, patterns, tokens, mode):
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for pattern in patterns:
        print(f"\n{pattern} ({mode}, us, max over ranks)")
        print(f"{'impl':34s}" + "".join(f"{t:>10d}" for t in tokens))
        for impl in impls:
            cells = []
            for t in tokens:
                row = next((r for r in rows if r["pattern"] == pattern and r["tokens"] == t
                            and r["impl"] == impl), None)
                value = row.get(f"{mode}_us") if row else None
                cells.append(f"{value:10.1f}" if value is not None else f"{'-':>10s}")
            if any(c.strip() != "-" for c in cells):
                print(f"{impl:34s}" + "".join(cells))


def plot(rows, patterns, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return False
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 5), squeeze=False)
    for ax, pattern in zip(axes[0], patterns):
        impls = list(dict.fromkeys(r["impl"] for r in rows if r["pattern"] == pattern))
        for i, impl in enumerate(impls):
            points = [(r["tokens"], r["graph_us"]) for r in rows if r["pattern"] == pattern
                      and r["impl"] == impl and r.get("graph_us") is not None]
            if points:
                style = "-" if impl in ("engine", "nccl_ar", "native") else "--"
                ax.plot(*zip(*points), style, marker="o", label=impl, linewidth=1,
                        color=plt.cm.tab20(i % 20))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"all_reduce + {pattern} (graph replay)")
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def add_arguments(parser):
    parser.add_argument("--tokens", type=nonempty_ints, default="1,16,128,1024,8192",
                        help="token counts, comma-separated")
    parser.add_argument("--hidden", type=positive_int, default=4096)
    parser.add_argument("--patterns", type=names(PATTERNS), default=",".join(PATTERNS),
                        help=f"comma-separated, among {','.join(PATTERNS)}")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--trials", type=positive_int, default=5)
    parser.add_argument("--replays", type=positive_int, default=20)
    parser.add_argument("--graph-calls", type=positive_int, default=CALLS_PER_GRAPH,
                        help="calls captured in each CUDA graph (its replay time divided by it)")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--no-compile-peer", dest="compile_peer", action="store_false")
    parser.add_argument("--no-flashinfer", dest="flashinfer", action="store_false",
                        help="skip the FlashInfer peer (its first use JIT-builds for minutes)")
    parser.add_argument("--no-native-inductor", dest="native_inductor", action="store_false")
    parser.add_argument("--noise", type=nonnegative_float, default=0.05,
                        help="how far above native the engine row may be before it is listed")
    parser.add_argument("--extra-rows", action="append", default=[], metavar="JSON",
                        help="rows timed by another process of the same run (the NCCL-symmetric "
                             "peer's results.json), merged into the tables; repeatable")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo CPU ranks, float32")


def finish(parser, args, world):
    """No rule between the sweep's flags: every value is checked by its type."""


def main(argv=None):
    args = parse(argv, add_arguments, finish, description=__doc__.split("\n")[0])
    tokens, patterns = args.tokens, args.patterns
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.dtype = "float32"
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    timer = Timer(device, args.trials, args.replays, args.graph_calls)
    flashinfer = None
    if args.flashinfer:
        flashinfer = open_flashinfer(None, max(tokens), args.hidden, getattr(torch, args.dtype),
                                     device)
    elif dist.get_rank() == 0:
        print("flashinfer: --no-flashinfer; its rows are skipped", flush=True)
    # One untimed case first, so that the first timed count finds the GPU, the process and the
    # engine as warm (clocks, allocator, first-launch paths) as every later count does: the first
    # count once read far slower in this sweep than the same kernel did elsewhere.
    run_case(args, patterns[0], tokens[0], device, None, timer, flashinfer)
    rows, cases = [], {}
    for pattern in patterns:
        for t in tokens:
            case_rows, info = run_case(args, pattern, t, device, None, timer, flashinfer)
            rows += case_rows
            cases[f"{pattern}/{t}"] = info
            if dist.get_rank() == 0:
                print(f"{pattern} tokens={t}: committed {info['committed']}, |engine - native| "
                      f"max {info['engine_vs_native_max_abs']:.3g}", flush=True)
    if dist.get_rank() == 0:
        rows += extra_rows(args.extra_rows, patterns, tokens, args.graph_calls)
        for mode in ("graph", "eager"):
            print_table(rows, patterns, tokens, mode)
        slower = above_native(rows, args.noise)
        print(f"\nengine above native by more than {args.noise:.0%}: "
              + (", ".join(f"{s['pattern']}/{s['tokens']} {s['mode']} {s['engine_us']:.1f} vs "
                           f"{s['native_us']:.1f} us" for s in slower) or "none"))
        mode = "eager" if args.cpu_smoke else "graph"  # no graphs on CPU
        print(f"FP8 epilogue cost, engine add_rms_norm_fp8* / engine add_rms_norm ({mode}): "
              + (", ".join(fp8_cost(rows, mode)) or "no rows"))
        if flashinfer is not None:
            print("engine speed-up over the fastest flashinfer row (graph): "
                  + (", ".join(engine_vs_flashinfer(rows)) or "no rows"))
        print(f"engine / the fastest all-reduce alone ({mode}): "
              + (", ".join(engine_vs_ar_alone(rows, mode)) or "no rows"))
        os.makedirs(args.out, exist_ok=True)
        meta = {"world_size": dist.get_world_size(), "hidden": args.hidden, "dtype": args.dtype,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "cases": cases, "noise": args.noise,
                "graph_calls": args.graph_calls, "replays": args.replays,
                "engine_above_native": slower}
        try:
            import triton
            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        plotted = plot(rows, patterns, os.path.join(args.out, "latency.png"))
        print(f"\nwrote {args.out}/results.json" + (" and latency.png" if plotted else ""))
    if flashinfer is not None:
        flashinfer.close()
    shutdown()


if __name__ == "__main__":
    main()
