"""Hugging Face models under transformers' own tensor parallelism: reduce-overhead torch.compile,
plain against the infini_dist pass, both against the collective-free step, and eager.

    infini-dist bench --hf llama,qwen2,mistral --out $OUT/hf     (one rank per GPU)
    infini-dist bench --hf llama --nproc 2 --cpu-smoke --layers 2 --hidden 64 --mlp 128 \\
        --heads 4 --kv-heads 2 --vocab 256 --context 8 --batches 2 --prefill 16   (gloo, fp32)

Per family (llama, qwen2, mistral by default; mixtral: 8 experts, top 2, each --mlp wide): a
config of --layers layers (hidden 4096, MLP 14336, 32 / 8 heads, vocab 32000 by default) with
random weights, built and saved with save_pretrained by rank 0 into a temp dir under --out,
then loaded on every rank with `tp_plan="auto"` (transformers' DTensor TP:
`distributed_config=DistributedConfig(tp_plan="auto")` where transformers has it, the `tp_plan=`
argument before). Nothing is downloaded.

Shapes: one decode step at each --batches size, over a StaticCache already filled with --context
positions by an eager prefill (the step writes position --context and reads the rest, so it can
be repeated and replayed); prefill of each --prefill length at batch 1 without a cache, logits of
the last position only (as generate() does).

Variants (names shared with `bench --model`'s report):
  inductor      torch.compile(model, mode=--mode)                           (plain)
  infini_dist   infini_dist.compile.compile_model(model, mode=--mode)       (with the pass)
  collective_free  the plain compile with every collective a no-op (launch/collective_free.py)
  eager         the TP model uncompiled (DTensor ops)
collective_free is the floor: the same sharded graph without communication, which no
all-reduce can beat. Its logits are partial sums and are not checked; its compile must have
replaced every collective (all_reduce, and the lm_head's all_gather), else the run fails.
--mode is reduce-overhead on GPU (cudagraph trees: the graphs are torch's, not ours) and default
on CPU. Each is timed over --iters calls after its first call (compile, tuning) and 3 more
(the cudagraph recording, then replays), each call between two CUDA events with no host sync
in the loop: median per rank, max over ranks. Every compiled row says whether its CUDA graphs
replayed ("cudagraphs", from torch's cudagraph-skip counter and reasons, and whether the last
timed call ran a recorded graph); a reduce-overhead row on GPU without replays gets a loud
warning, since its time then is not a graph replay's. The compiled variants are then timed again in
--rounds interleaved rounds of --round-calls calls (launch/step_timing.py: per-call, host and
wall time, spread, graphs per step; --profile adds a profiler view of a decode step): those are
the times the table compares, and each
shape's infini_dist and plain steps over its collective-free step (b/f, a/f; `over_floor` in
results.json). On a GPU the same rounds are timed once more with the host kept ahead of the
device (a sleep kernel in front of each round, step_timing.time_device): the step as the device
makes it, and its ratios to the floor's (`over_floor_device`). A decode step whose host loop
takes longer than its kernels (transformers' at small batches) shows the host in the first
ratios and the sites in the second. The error is the relative L2 of the logits against eager's,
max over ranks. A compile or run failure becomes a table entry.

Target (issue #26; reported, not enforced): at TP = 2 the all-reduces are a small share of a
decode step, so a speed-up over plain is bounded by what they cost; the floor is the honest
yardstick. Decode at batch <= 32: infini_dist's step <= 1.03x the collective-free step (plain's
ratio beside it); prefill: never slower than plain.

Writes a table per family on rank 0, results.json and latency_<family>.png under --out. Exit
status 1 when infini_dist's logits do not match eager's within --tol (or could not be checked),
or the collective-free compile kept a collective.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from infini_dist.launch import collective_free, shutdown
from infini_dist.launch.arguments import (add_decode_shapes, add_matmul_prologue, add_model_sizes,
                                          names, parse, positive_float, positive_int,
                                          positive_ints)
from infini_dist.launch.bench_model import Bench, run_shape
from infini_dist.launch.job import dynamo_compiles, run_meta, setup
from infini_dist.launch.cudagraph_watch import CudagraphWatch
from infini_dist.launch.model_report import (FLOOR, VARIANTS, Target, add_floor_ratios, plot,
                                             print_details, summary)
from infini_dist.launch.step_timing import (profile_step, time_device, time_interleaved,
                                            timing_lines)
from infini_dist.launch.tp_decoder import Shape

FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
            "mixtral": "MixtralConfig"}
DEFAULT_FAMILIES = ("llama", "qwen2", "mistral")  # dense; --hf mixtral asks for the MoE one
TARGET = Target(max_batch=32, floor_ratio=1.03)


# ---- the model ------------------------------------------------------------------------------------

def make_config(family: str, args):
    import transformers
    config_class = getattr(transformers, FAMILIES[family])
    # Full attention everywhere: Mistral's default sliding window would make the decode step
    # read a different span than prefill at long contexts. Mixtral: 8x7B's routing.
    extra = {"sliding_window": None} if family in ("mistral", "mixtral") else {}
    if family == "mixtral":
        extra.update(num_local_experts=8, num_experts_per_tok=2)
    return config_class(hidden_size=args.hidden, intermediate_size=args.mlp,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                        num_hidden_layers=args.layers, vocab_size=args.vocab,
                        max_position_embeddings=max([args.context + 1, *args.prefill]),
                        tie_word_embeddings=False, **extra)


def tp_load_kwargs() -> dict:
    """transformers >= 5.18 takes the plan in DistributedConfig; 5.17 (GPU image): tp_plan=.
    The TP size is given where it can be: 5.23 derives it from $WORLD_SIZE, which only torchrun
    sets, and left at 1 the model loads unsharded (and has no all_reduce to fuse)."""
    import transformers
    config_class = getattr(transformers, "DistributedConfig", None)
    if config_class is not None and "tp_plan" in inspect.signature(config_class).parameters:
        extra = {"tp_size": dist.get_world_size()} if dist.is_initialized() and \
            "tp_size" in inspect.signature(config_class).parameters else {}
        return {"distributed_config": config_class(tp_plan="auto", **extra)}
    return {"tp_plan": "auto"}


def check_sharded(model) -> None:
    """Raises where transformers loaded the model whole on every rank (no DTensor parameter):
    a TP bench or tuning of that model would measure a model with no collective in it."""
    from torch.distributed.tensor import DTensor
    if dist.get_world_size() > 1 and \
            not any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError(
            "transformers did not shard the model (no DTensor parameter on this rank): run "
            "under torchrun, or set WORLD_SIZE, RANK and LOCAL_RANK as torchrun does")


def load_tp_model(config, out_dir: str, device, dtype, control):
    """Random weights of `config` saved by rank 0 under `out_dir`, loaded sharded on every
    rank."""
    from transformers import AutoModelForCausalLM
    path = [None, None]  # the directory, or rank 0's error: the others must not wait for it
    if dist.get_rank() == 0:
        try:
            os.makedirs(out_dir, exist_ok=True)
            path[0] = tempfile.mkdtemp(prefix=f"{config.model_type}-", dir=out_dir)
            torch.manual_seed(0)
            with torch.device(device):  # random init of ~1B parameters is slow on the host
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.save_pretrained(path[0])
            del model
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            path[1] = f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(path, src=0, group=control)
    if path[1]:
        if path[0] and dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
        raise RuntimeError(f"rank 0 could not build and save the {config.model_type} model: "
                           f"{path[1]}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path[0], dtype=dtype, **tp_load_kwargs())
    finally:
        dist.barrier(group=control)  # every rank has read the files (or failed to)
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
    check_sharded(model)
    return model.eval()


# ---- shapes ---------------------------------------------------------------------------------------

def shape_calls(model, compiled: dict, watches: dict, shape: Shape, args, device) -> dict:
    """name -> call returning the logits; every rank builds the same token ids. Each compiled
    variant's calls go through its CudagraphWatch in `watches`."""
    from transformers import StaticCache
    gen = torch.Generator(device=device).manual_seed(11 + shape.batch * 7 + shape.tokens)
    vocab, counters = model.config.vocab_size, []
    if shape.kind == "prefill":
        ids = torch.randint(0, vocab, (1, shape.tokens), generator=gen, device=device)
        kwargs = {"input_ids": ids, "use_cache": False, "logits_to_keep": 1}
    else:
        prompt = torch.randint(0, vocab, (shape.batch, args.context), generator=gen, device=device)
        cache = StaticCache(config=model.config, max_cache_len=args.context + 1)
        with torch.no_grad():  # eager prefill: the cache is initialised (and marked static) here
            model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(args.context, device=device))
        ids = torch.randint(0, vocab, (shape.batch, 1), generator=gen, device=device)
        kwargs = {"input_ids": ids, "past_key_values": cache, "use_cache": True,
                  "cache_position": torch.tensor([args.context], device=device)}
        # Newer transformers (5.23) keep the fill level on the device and advance it at every
        # update, instead of writing at cache_position; it goes back before each step.
        counters = [layer.cumulative_length for layer in cache.layers
                    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        starts = [c.clone() for c in counters]
    graphs = device.type == "cuda" and args.mode != "default"  # cudagraph trees

    def call(fn):
        # The fill level is a static address (StaticCache marks it): reset in place, the
        # recorded graph reads the new value at replay.
        if counters:
            torch._foreach_copy_(counters, starts)
        if graphs:  # each call is a new step: the last one's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return fn(**kwargs).logits

    calls = {"eager": lambda: call(model)}
    calls.update({v: (lambda f=f, w=watches[v]: w.call(lambda: call(f), device))
                  for v, f in compiled.items()})
    return calls


def note_cudagraphs(row: dict, watch: CudagraphWatch, bench: Bench, args) -> None:
    """Adds whether the variant's graphs replayed, on every rank's word, to its row; a compiled
    variant that should run CUDA graphs and did not is a bench bug, said loudly."""
    report = watch.report() if args.mode != "default" else {"cudagraphs": False}
    report["cudagraphs"] = bench.worst(0.0 if report["cudagraphs"] else 1.0) == 0.0
    row.update(report)
    if bench.cuda and args.mode != "default" and not report["cudagraphs"] \
            and dist.get_rank() == 0:
        print(f"\n!!! WARNING: {row['shape']} {row['variant']}: mode={args.mode} but CUDA graphs "
              f"did NOT replay (rank 0: {report.get('cudagraph_skip_reasons', ['other rank'])});"
              f" its time is not a graph replay's\n", flush=True)


def profile_variants(bench: Bench, steps: dict, family: str, shape: Shape, args) -> dict:
    """Interleaved timing of `steps` (step_timing.py), on a GPU the same steps as the device
    alone makes them (`time_device`), and with --profile a profiler view of a decode step of
    each (traces under --out from rank 0). Each variant's `timing_graphs` counts
    the Dynamo graphs compiled meanwhile: anything but 0 means the timing ran other code."""
    graphs = dynamo_compiles()
    timings = time_interleaved(bench, steps, args.rounds, args.round_calls)
    if bench.cuda:
        device = time_device(bench, steps, args.rounds, args.round_calls,
                             {v: timings[v]["host_us"] for v in steps})
        for variant, fields in device.items():
            timings[variant].update(fields)
    if args.profile and shape.kind == "decode":
        for variant, step in steps.items():
            trace = os.path.join(args.out, f"trace_{family}_{shape.name}_{variant}.json"
                                 .replace(" ", "_")) if dist.get_rank() == 0 else None
            timings[variant]["profile"] = profile_step(step, 3, bench.cuda, trace)
    for fields in timings.values():
        fields["timing_graphs"] = int(bench.worst(dynamo_compiles() - graphs))
    return timings


def bench_family(bench: Bench, family: str, args, device, dtype, control) -> list[dict]:
    import infini_dist.compile as idc
    begin = time.perf_counter()
    model = load_tp_model(make_config(family, args), args.out, device, dtype, control)
    load_s = bench.worst(time.perf_counter() - begin)
    mode = None if args.mode == "default" else args.mode
    compiled = {}
    if "inductor" in args.variants:
        compiled["inductor"] = torch.compile(model, mode=mode, dynamic=False)
    if "infini_dist" in args.variants:
        # One compile, as the recorded tables had (sites and graphs are counted per variant)
        compiled["infini_dist"] = idc.compile_model(model, mode=mode, dynamic=False,
                                                    recompile_decided=False)
    if FLOOR in args.variants:
        compiled[FLOOR] = collective_free.compile_model(model, bench.floor, mode=mode,
                                                       dynamic=False)
    if dist.get_rank() == 0:
        print(f"\n{family}: loaded with transformers TP in {load_s:.1f}s", flush=True)
    rows = []
    for shape in args.shapes:
        watches = {v: CudagraphWatch() for v in compiled}
        with contextlib.ExitStack() as stack:
            for watch in watches.values():
                stack.enter_context(watch)
            calls = shape_calls(model, compiled, watches, shape, args, device)
            shape_rows = run_shape(bench, shape, calls)
            # The compiled variants again, interleaved in rounds: the numbers compared. Under
            # no_grad as their first calls were: grad mode is guarded, a change recompiles.
            timed = [r["variant"] for r in shape_rows if r["variant"] in compiled
                     and "median_us" in r]
            if timed:
                with torch.no_grad():
                    interleaved = profile_variants(bench, {v: calls[v] for v in timed}, family,
                                                   shape, args)
        for row in shape_rows:
            row["family"] = family
            if row["variant"] in watches:
                note_cudagraphs(row, watches[row["variant"]], bench, args)
            if row["variant"] in timed:
                row["sequential_us"] = row["median_us"]
                row.update(interleaved[row["variant"]])
                row["median_us"] = row["call_us"]
            rows.append(row)
        if bench.cuda:
            torch.cuda.empty_cache()
    del model, compiled
    torch._dynamo.reset()  # drop this family's graphs (and cudagraph trees) before the next
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()
    return rows


# ---- main -----------------------------------------------------------------------------------------

def add_arguments(parser):
    parser.add_argument("--hf", type=names(tuple(FAMILIES)), default=",".join(DEFAULT_FAMILIES),
                        dest="families", metavar="FAMILY[,FAMILY]",
                        help=f"comma-separated families among {','.join(FAMILIES)}")
    add_model_sizes(parser, layers=4, vocab=32000)
    add_decode_shapes(parser, batches="1,8,32")
    parser.add_argument("--prefill", type=positive_ints, default="1024,2048",
                        help="prefill lengths ('' for none)")
    parser.add_argument("--iters", type=positive_int, default=100,
                        help="timed calls per variant and shape, one variant after the other")
    parser.add_argument("--rounds", type=positive_int, default=10,
                        help="interleaved rounds of the compiled variants (their reported times)")
    parser.add_argument("--round-calls", type=positive_int, default=50,
                        help="calls per variant and round")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler view of 3 decode steps per compiled variant")
    parser.add_argument("--variants", type=names(VARIANTS), default=",".join(VARIANTS),
                        help=f"comma-separated, among {','.join(VARIANTS)}")
    parser.add_argument("--mode", default=None, choices=["default", "reduce-overhead",
                                                         "max-autotune"],
                        help="torch.compile mode of the compiled variants (default: "
                             "reduce-overhead on GPU, default with --cpu-smoke)")
    # bf16 logits of 4 random layers: plain Inductor against eager is the yardstick.
    parser.add_argument("--tol", type=positive_float, default=None,
                        help="max relative L2 error of the logits vs eager (default 5e-2 bf16, "
                             "1e-4 fp32)")
    add_matmul_prologue(parser)
    parser.add_argument("--out", default="bench_hf_out")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="gloo CPU ranks, float32, no CUDA graphs: checks the script itself")


def finish(parser, args, world):
    args.variants = [v for v in VARIANTS if v in args.variants]  # the report's order
    args.shapes = [Shape("decode", b, 1) for b in args.batches] + \
        [Shape("prefill", 1, t) for t in args.prefill]
    if not args.shapes:
        parser.error("no shape: give --batches or --prefill")
    if args.heads % args.kv_heads or args.kv_heads % world or args.mlp % world:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}, "
                     f"and --kv-heads and --mlp {args.mlp} divisible by {world} ranks")
    args.mode = args.mode or ("default" if args.cpu_smoke else "reduce-overhead")
    if args.tol is None:
        args.tol = 1e-4 if args.cpu_smoke else 5e-2


def parse_args(argv=None):
    return parse(argv, add_arguments, finish, description=__doc__.split("\n")[0])


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device, dtype, control = setup(args)
    rank = dist.get_rank()
    import infini_dist
    if args.matmul_prologue is not None:
        infini_dist.config.matmul_prologue = args.matmul_prologue
    if rank == 0:
        print(f"TP={dist.get_world_size()} {device.type} {dtype}, transformers TP, "
              f"families {args.families}; inductor = torch.compile(mode={args.mode!r}), "
              f"infini_dist = the same with the pass, {FLOOR} = the same with no-op "
              f"collectives; {args.iters} timed calls each", flush=True)
    bench = Bench(args, device, control, capture=False)
    rows, lines = [], []
    verdict = {"target_misses": [], "device_target_misses": [], "check_failures": []}
    for family in args.families:
        family_rows = bench_family(bench, family, args, device, dtype, control)
        add_floor_ratios(family_rows)
        rows += family_rows
        family_lines, family_verdict = summary(family_rows, args.shapes, args, args.cpu_smoke,
                                               TARGET)
        if args.mode != "default":  # above the target and correctness lines
            missed = [f"{r['shape']} {r['variant']}" for r in family_rows
                      if r.get("cudagraphs") is False]
            replayed = f"NO for {', '.join(missed)} (bench bug on GPU)" if missed \
                else "every compiled row"
            at = next(i for i, line in enumerate(family_lines) if line.startswith("target: "))
            family_lines.insert(at, f"cudagraphs replayed: {replayed}")
        lines += ["", f"== {family} =="] + timing_lines(family_rows, args.shapes) + family_lines
        for key, misses in family_verdict.items():
            verdict[key] += [f"{family} {m}" for m in misses]
        if rank == 0:
            print_details(family_rows)
    if rank == 0:
        import transformers
        os.makedirs(args.out, exist_ok=True)
        meta = run_meta(args, device, dtype, started)
        meta.update(families=args.families, transformers=transformers.__version__,
                    mode=args.mode, matmul_prologue=infini_dist.config.matmul_prologue,
                    config={k: getattr(args, k) for k in (
                        "layers", "hidden", "mlp", "heads", "kv_heads", "vocab", "context")})
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "verdict": verdict}, f, indent=1)
        plotted = [plot([r for r in rows if r["family"] == family], args.shapes,
                        os.path.join(args.out, f"latency_{family}.png"),
                        title=f"{family}, transformers TP={meta['world_size']}, {args.mode}")
                   for family in args.families]
        print(f"\nwrote {args.out}/results.json" + (" and latency_*.png" if all(plotted) else "")
              + f"; {meta['wall_s']:.0f}s in all")
        print("\n".join(lines), flush=True)
    shutdown()
    return 1 if verdict["check_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
