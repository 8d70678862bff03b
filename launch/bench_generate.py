"""Hugging Face generate() on a TP-sharded model with the infini_dist pass, in the ways users
write it: one route per process, and a driver that alternates those processes.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_generate \
        --variant enable --json $OUT/enable.json              # one route (GPU: bf16, NCCL)
    python -m infini_dist.launch.bench_generate --alternate 3 --out $OUT/generate   # K rounds

Routes (greedy, static cache; bench_hf's model: random weights, transformers' TP plan):
  plain           cache_implementation="static": generate() compiles the forward itself
                  (CompileConfig's default, mode="reduce-overhead")
  enable          infini_dist.compile.enable() first, then as plain
  compile_config  compile_config = CompileConfig(mode=None, options=infini_dist.compile.
                  inductor_options({"triton.cudagraphs": True})): reduce-overhead's option plus
                  the pass (torch.compile takes mode or options, never both)
  eager           compilation disabled (the reference)
generate() compiles only on accelerators; on CPU (--cpu-smoke, gloo, fp32) the compiled routes
set CompileConfig's `_compile_all_devices` (transformers' switch "to compile on e.g. CPU ... for
testing"), in Inductor's default mode: CUDA graphs need a GPU.

Each process runs --warmup generate calls (compile, tuning, graph recording), then --reps timed
ones: the wall time (synchronised) and each decode step's time, from a logits processor that
marks every new token (a CUDA event on GPU, the clock on CPU), so a step includes HF's host loop.
Two models in one process share one forward code object and hit Dynamo's recompile limit: hence
one route per process, and the driver's fresh torchrun job per route and round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from infini_dist.launch import shutdown
from infini_dist.launch.arguments import (add_model_sizes, names, nonnegative_int, parse,
                                          positive_int)
from infini_dist.launch.bench_hf import FAMILIES, load_tp_model, make_config
from infini_dist.launch.bench_model import Bench
from infini_dist.launch.job import dynamo_compiles, setup
from infini_dist.launch.cudagraph_watch import CudagraphWatch
from infini_dist.launch.generate_report import VARIANTS, speed, summarize, table, verdict
MODULE = "infini_dist.launch.bench_generate"  # what torchrun starts (__name__ may be __main__)


# ---- one route in this process -------------------------------------------------------------------

def generation_config(model, variant: str, cpu: bool, new_tokens: int):
    """The model's generation config for `variant`: greedy, exactly `new_tokens` tokens (no EOS,
    random weights could stop early), static cache, and the route's compile settings."""
    import copy

    from transformers import CompileConfig
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                  pad_token_id=0, cache_implementation="static")
    if variant == "eager":
        config.disable_compile = True
        return config
    if variant == "compile_config":
        import infini_dist.compile as idc
        # What the README shows: reduce-overhead's option (CUDA graphs) with our pass.
        options = idc.inductor_options({} if cpu else {"triton.cudagraphs": True})
        config.compile_config = CompileConfig(mode=None, options=options)
    elif cpu:  # plain and enable: HF's default config, which it applies only on accelerators
        config.compile_config = CompileConfig(mode="default")
    if cpu:
        config.compile_config._compile_all_devices = True
    return config


class StepClock:
    """A logits processor that marks the end of each new token's forward and returns the scores
    untouched: generate() calls it once per token, the prefill's token first."""

    def __init__(self, device, tokens: int):
        self.cuda = device.type == "cuda"
        # Events made before the call: making one inside the loop would add host time.
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(tokens)] \
            if self.cuda else []
        self.seen = 0

    def __call__(self, input_ids, scores):
        if self.cuda:
            self.marks[self.seen].record()
        else:
            self.marks.append(time.perf_counter())
        self.seen += 1
        return scores

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive tokens: the decode steps (call after a sync)."""
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:self.seen])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def timed_generate(model, bench: Bench, prompt, config, watch: CudagraphWatch):
    """(new token ids, wall ms, decode step ms) of one generate call."""
    from transformers import LogitsProcessorList
    clock = StepClock(bench.device, config.max_new_tokens)
    bench.sync()
    start = time.perf_counter()
    out = watch.call(lambda: model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=config,
        logits_processor=LogitsProcessorList([clock])), bench.device)
    bench.sync()
    wall_ms = 1e3 * (time.perf_counter() - start)
    if clock.seen != config.max_new_tokens:
        raise RuntimeError(f"generate made {clock.seen} tokens, asked for "
                           f"{config.max_new_tokens}")
    return out[:, prompt.shape[1]:].tolist(), wall_ms, clock.step_ms()


def profile(call, args) -> None:
    """One more generate call under torch.profiler: where a decode step's host time goes (ops by
    self CPU time, and the launch calls outside CUDA graphs against graph launches), per rank."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])
    with torch.profiler.profile(activities=activities) as prof:
        call()
    events = prof.key_averages()
    launches = {e.key: e.count for e in events
                if e.key.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy",
                                     "cudaMemset", "cudaStreamSynchronize", "cudaEventRecord"))}
    text = (f"{args.variant}, rank {dist.get_rank()}: one generate call of {args.new_tokens} "
            f"tokens\nruntime calls: {json.dumps(launches)}\n" +
            events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"{args.variant}_rank{dist.get_rank()}.txt"), "w") as f:
        f.write(text)


def run_variant(args) -> int:
    import infini_dist.compile as idc
    started = time.perf_counter()

    def phase(name: str) -> None:  # where a job's time goes (a cut-off run shows how far it got)
        if dist.get_rank() == 0:
            print(f"[{args.variant}] {name} done at {time.perf_counter() - started:.1f} s",
                  flush=True)

    device, dtype, control = setup(args)  # also: no FX graph cache, so site counts are real
    bench = Bench(args, device, control, capture=False)
    sizes = argparse.Namespace(**vars(args), context=args.prompt + args.new_tokens, prefill=[])
    model = load_tp_model(make_config(args.family, sizes), args.out, device, dtype, control)
    phase("load (checkpoint written, loaded under TP)")
    if args.variant == "enable":
        idc.enable()  # before generate: HF's own torch.compile then runs the pass
    config = generation_config(model, args.variant, device.type == "cpu", args.new_tokens)
    gen = torch.Generator().manual_seed(5)  # the same prompt on every rank and in every process
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt),
                           generator=gen).to(device)
    watch, walls, steps = CudagraphWatch(), [], []
    with watch, torch.no_grad():
        for index in range(args.warmup):
            tokens, _, _ = timed_generate(model, bench, prompt, config, watch)
            phase(f"warm-up call {index + 1} (compile, tuning, graph recording)")
        graphs_before = dynamo_compiles()
        for _ in range(args.reps):
            tokens, wall_ms, step_ms = timed_generate(model, bench, prompt, config, watch)
            walls.append(wall_ms)
            steps += step_ms
        phase(f"{args.reps} timed calls")
        if args.profile:
            profile(lambda: timed_generate(model, bench, prompt, config, watch), args)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tokens, group=control)
    step = bench.worst(statistics.median(steps)) if steps else float("nan")
    wall = bench.worst(statistics.median(walls))
    result = {
        "variant": args.variant, "family": args.family, "world_size": dist.get_world_size(),
        "device": torch.cuda.get_device_name(device) if bench.cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "batch": args.batch, "prompt": args.prompt,
        "new_tokens": args.new_tokens, "reps": args.reps, "tokens": tokens,
        "ranks_agree": all(t == tokens for t in every),
        "step_ms": step, "tokens_per_s": 1e3 * args.batch / step,
        "step_ms_p10_p90": [bench.worst(q) for q in statistics.quantiles(steps, n=10)[::8]]
        if len(steps) > 1 else [],
        "wall_ms": wall, "e2e_tokens_per_s": 1e3 * args.batch * args.new_tokens / wall,
        # What the pass did in this process: graphs it saw, sites it made, what they committed;
        # Dynamo's graphs include the engine's own epilogue compiles (native_inductor)
        "pass_graphs": idc.stats["graphs"], "sites": idc.stats["sites"],
        "last_sites": len(idc.last_sites), "decisions": sorted(
            {(d["op"], d["choice"]) for d in idc.decisions()}),
        "dynamo_graphs": dynamo_compiles(),
        "timing_graphs": dynamo_compiles() - graphs_before,
    }
    result["pass_ran"] = result["sites"] > 0
    result.update(watch.report() if bench.cuda and args.variant != "eager"
                  else {"cudagraphs": False})
    if dist.get_rank() == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    shutdown()
    return 0


# ---- the driver: alternating processes -----------------------------------------------------------

def child_argv(args, variant: str, path: str) -> list[str]:
    """A round's argv for one route: every model and generation flag as this driver got it."""
    argv = ["--variant", variant, "--json", path, "--out", args.out]
    for flag in ("family", "layers", "hidden", "mlp", "heads", "kv_heads", "vocab", "batch",
                 "prompt", "new_tokens", "warmup", "reps"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + (["--cpu-smoke"] if args.cpu_smoke else []) + \
        (["--profile", args.profile] if args.profile else [])


def alternate(args) -> int:
    """--alternate K: K rounds of fresh torchrun jobs, one per route; the table after each round
    (a run cut short still leaves the rounds it finished) and summary.json."""
    from infini_dist.launch.cli import default_nproc, torchrun
    nproc = args.nproc or default_nproc()
    runs, problems = {v: [] for v in args.variants}, []
    for round_ in range(args.alternate):
        for variant in args.variants:  # plain, enable, compile_config, plain, ...
            path = os.path.join(args.out, f"round{round_}_{variant}.json")
            print(f"\n== round {round_ + 1}/{args.alternate}: {variant} ==", flush=True)
            began = time.perf_counter()
            status = torchrun(MODULE, nproc, child_argv(args, variant, path))
            print(f"== {variant}: job exited with status {status} after "
                  f"{time.perf_counter() - began:.1f} s", flush=True)
            try:
                with open(path) as f:  # a job that wrote its result and then failed to exit
                    runs[variant].append(dict(json.load(f), exit_status=status))  # is wrong too
            except OSError as error:
                runs[variant].append({"error": f"exit status {status}, no result: {error}"})
        rows = summarize(runs)
        fp32 = any(r.get("dtype") == "float32" for rs in runs.values() for r in rs)
        problems = verdict(rows, fp32)
        lines = [f"\ngenerate(): {args.family}, {nproc} ranks, batch {args.batch}, prompt "
                 f"{args.prompt}, {args.new_tokens} new tokens, {round_ + 1} of {args.alternate} "
                 f"alternating round(s); tokens/s = batch / median decode step; spread over "
                 f"processes"] + table(rows, args.new_tokens) + \
            [f"speed: {speed(rows)}", f"verdict: {'; '.join(problems) or 'ok'}"]
        print("\n".join(lines), flush=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({"rows": rows, "problems": problems, "fp32": fp32,
                       "rounds": round_ + 1}, f, indent=1)
    return 1 if problems else 0


# ---- arguments -----------------------------------------------------------------------------------

def add_arguments(parser):
    parser.add_argument("--variant", choices=VARIANTS, help="run this one route (under torchrun)")
    parser.add_argument("--alternate", type=positive_int, default=None, metavar="K",
                        help="driver: K rounds of --variants, each a fresh torchrun job")
    parser.add_argument("--variants", type=names(VARIANTS), default="plain,enable,compile_config",
                        help="the driver's routes, in round order")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="driver: ranks per job (default: one per GPU, or 2 on CPU)")
    parser.add_argument("--family", choices=tuple(FAMILIES), default="llama")
    add_model_sizes(parser, layers=4, vocab=32000)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--warmup", type=nonnegative_int, default=2,
                        help="untimed generate calls first (compile, tuning, graph recording)")
    parser.add_argument("--reps", type=positive_int, default=3, help="timed generate calls")
    parser.add_argument("--json", default=None, help="one route: write its result here")
    parser.add_argument("--out", default="bench_generate_out",
                        help="the driver's results; the model's temporary files")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo CPU ranks, float32")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after the timed calls, profile one more and write each rank's "
                             "host-time table to DIR")


def finish(parser, args, world):
    if (args.variant is None) == (args.alternate is None):
        parser.error("give one of --variant (one route) and --alternate K (the driver)")
    if args.alternate:  # the jobs it will start, not this process
        from infini_dist.launch.cli import default_nproc
        world = args.nproc or default_nproc()
    if args.heads % args.kv_heads or args.kv_heads % world or args.mlp % world:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}, "
                     f"and --kv-heads and --mlp {args.mlp} divisible by {world} ranks")


def main(argv=None) -> int:
    args = parse(argv, add_arguments, finish, description=__doc__.split("\n")[0])
    if args.alternate:
        os.makedirs(args.out, exist_ok=True)
        return alternate(args)
    return run_variant(args)


if __name__ == "__main__":
    sys.exit(main())
