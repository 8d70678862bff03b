"""A tensor-parallel training step: plain torch.compile against torch.compile + the infini_dist pass.

    infini-dist bench --train --out bench_train_out [--tokens 2048,8192 --steps 50 --layers 4
        --hidden 4096 --mlp 14336 --heads 32 --kv-heads 8]
    infini-dist bench --train --nproc 2 --device cpu --tokens 16 --steps 3 --warmup 1 \\
        --layers 1 --hidden 32 --mlp 64 --heads 4 --kv-heads 2       (gloo CPU ranks, float32)

The model is launch/tp_decoder.py's decoder with trainable weights and Megatron's two TP
functions: the row-parallel outputs are all-reduced in forward (identity in backward), and the
inputs of the column-parallel projections have their gradient all-reduced in backward (identity
in forward). So the forward graph has all_reduce -> add -> RMSNorm sites (the norm's rsqrt saved
for backward) and the backward graph the input-gradient all_reduces with their epilogues.

One step: forward over `tokens` tokens (batch 1), MSE against a fixed replicated target,
backward, AdamW (`--optimizers`: torch's foreach implementation, its fused one, or both, each a
row of its own). Per tokens-per-step, optimizer and variant (inductor: torch.compile(model);
infini_dist: compile_model(model), after forward and backward rounds until no round compiles
(its sites decided, it compiled itself again), so sites decided native are Inductor's code;
inductor_overlap and infini_dist_overlap: the same two with Inductor's compute/communication overlap options,
OVERLAP; infini_dist_forward_overlap: the latter with config.backward_sites off;
infini_dist_wgrad: the pass with the "overlap" fusion type, each backward site running its
weight-gradient GEMMs beside its all_reduce, asked for by --variants;
infini_dist_matmul_prologue: the pass with config.matmul_prologue on (its "auto" leaves it off
in these graphs, which run without CUDA graphs), asked for by --variants beside infini_dist for
the flag's A/B in one run; collective_free:
torch.compile(model) with every collective of its forward and backward graphs a local no-op,
the floor of issue #27's target, launch/collective_free.py), a fresh model with the same
weights trains --steps steps;
after --warmup steps (compile and tuning) each step is timed, median per rank, max over ranks.
The pass's loss curves must agree with inductor's within --tol (bf16 noise on GPU); exit status
1 if they do not. The floor's curve is not checked (its sums are partial) and must leave no
collective. Writes the table on stdout and results.json + table.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from infini_dist.launch import collective_free, shutdown
from infini_dist.launch.arguments import (add_matmul_prologue, add_model_sizes, names,
                                          nonempty_ints, nonnegative_int, parse, positive_float,
                                          positive_int, usage_error)
from infini_dist.launch.job import dynamo_compiles, setup
from infini_dist.launch.step_timing import sleep_cycles_for
from infini_dist.launch.tp_decoder import Decoder, ModelConfig, check_shapes

# infini_dist_eager_timing: the pass with its sites timed eagerly (benchmark_cuda_graphs off),
# host cost included, as this graph runs them (no CUDA graphs), instead of under graph replay.
# inductor_overlap: plain compile with Inductor's own compute/communication overlap (its
# overlap scheduler moves each NCCL collective's start early and its wait late, so the backward
# all-reduces can run under the weight-gradient GEMMs): the user's best plain path, a peer.
# infini_dist_overlap: the pass under the same Inductor options, as such a user would add it;
# infini_dist_forward_overlap: the same with config.backward_sites off, so the backward
# all-reduces stay NCCL's under Inductor's overlap and only the forward sites are ours.
# infini_dist_wgrad: the pass with the "overlap" fusion type, so that each backward site takes
# the weight-gradient GEMMs it can run beside its all_reduce (scheduler/backends/symm_overlap.py).
# infini_dist_matmul_prologue: the pass with config.matmul_prologue on whatever the flag says,
# so one run compares the pass with and without the GEMM + all_reduce sites (the flag's A/B).
FLOOR = "collective_free"
WGRAD = "infini_dist_wgrad"
MATMUL = "infini_dist_matmul_prologue"
VARIANTS = ("inductor", "inductor_overlap", "infini_dist", "infini_dist_overlap",
            "infini_dist_forward_overlap", "infini_dist_eager_timing", WGRAD, MATMUL, FLOOR)
OVERLAP = {"reorder_for_compute_comm_overlap": True,  # config.py's recommended passes
           "reorder_for_compute_comm_overlap_passes": [
               "reorder_communication_preserving_peak_memory", "sink_waits_iterative",
               "reorder_communication_preserving_peak_memory"]}
OPTIMIZERS = ("foreach", "fused")
TARGET = 1.02  # issue #27: the pass's step over the collective-free step, at 2048 tokens


class _ReduceFromRanks(torch.autograd.Function):
    """Row-parallel output: summed over the ranks; its gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToRanks(torch.autograd.Function):
    """Column-parallel input: each rank's gradient covers its columns only, so it is summed."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad, "sum", ctx.group_name)), None


class TrainDecoder(Decoder):
    def __init__(self, cfg, group, device, dtype):
        super().__init__(cfg, group, device, dtype)
        for p in self.parameters():
            p.requires_grad_(True)

    def all_reduce(self, x, eager_nccl: bool = False):
        return _ReduceFromRanks.apply(x, self.group_name)

    def column_input(self, h):
        return _CopyToRanks.apply(h, self.group_name)


def step_data(tokens: int, args, device, dtype) -> tuple:
    """(input, target) of every step: replicated, fixed per tokens-per-step."""
    shared = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(1, tokens, args.model.hidden, generator=shared, device=device).to(dtype)
    return x, torch.randn(1, tokens, args.model.hidden, generator=shared, device=device)


def decide_then_recompile(model, tokens: int, args, device, dtype, control, options=None):
    """compile_model with the pass, then forward and backward steps (no optimizer step: the
    weights stay the other variants') until one compiles nothing on any rank. As in a user's
    first steps, the sites decide and compile_model compiles itself again (compile/recompile.py).
    Returns it with (sites, sites left native) of its last compile, the one timed, and how many
    times it compiled again."""
    import infini_dist.compile as idc
    from infini_dist.compile.recompile import MAX_RECOMPILES
    x, target = step_data(tokens, args, device, dtype)
    forward = idc.compile_model(model, options=options)
    for index in range(MAX_RECOMPILES + 2):
        before, drops = dynamo_compiles(), idc.recompiles(forward)
        sites, native = idc.stats["sites"], idc.stats["native_sites"]
        torch.nn.functional.mse_loss(forward(x).float(), target).backward()
        model.zero_grad(set_to_none=True)
        if index == 0 or idc.recompiles(forward) > drops:  # the model compiled (again)
            last = (idc.stats["sites"] - sites, idc.stats["native_sites"] - native)
        # the native choices' epilogues compile as they tune: a round of neither ends it
        compiled = torch.tensor([dynamo_compiles() - before])
        dist.all_reduce(compiled, op=dist.ReduceOp.MAX, group=control)  # one exit on every rank
        if not int(compiled):
            break
    return forward, (*last, idc.recompiles(forward))


def train_curve(model, forward, tokens: int, optimizer_kind: str, args, device, dtype,
                control) -> dict:
    """Loss per step and the median timed step (max over ranks). With --head-start-ms, as many
    steps again, each behind a sleep kernel of that length, timed less the sleep: the step as the
    device alone makes it, host stalls hidden (head_start_step_ms)."""
    x, target = step_data(tokens, args, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  **{optimizer_kind: True})  # foreach=True or fused=True
    losses, times = [], []

    def step(sleep_cycles: int = 0, host: list | None = None) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        marks = [time.perf_counter()]
        loss = torch.nn.functional.mse_loss(forward(x).float(), target)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        losses.append(float(loss.detach()))  # syncs the device
        if host is not None:
            host.append([b - a for a, b in zip(marks, marks[1:])])
        return time.perf_counter() - start

    for index in range(args.steps):
        if index == args.warmup:
            compiles = dynamo_compiles()
        took = step()
        if index >= args.warmup:
            times.append(took)
    row = {"losses": losses[:], "step_ms": max_over_ranks(times, control) * 1e3,
           "compiles_while_timed": dynamo_compiles() - compiles}
    row["tokens_per_s"] = tokens / row["step_ms"] * 1e3
    if args.head_start_ms and device.type == "cuda":
        cycles, sleep_s = sleep_cycles_for(args.head_start_ms * 1e-3, device)
        host: list = []
        from infini_dist.kernels import express
        built = express.module()
        hits = built.hits() if built is not None else 0
        ahead = [step(cycles, host) - sleep_s for _ in range(args.steps - args.warmup)]
        # site calls a step that the C++ table launched (kernels/express.py)
        row["cpp_launches_per_step"] = ((built.hits() - hits) / len(ahead)
                                        if built is not None else 0.0)
        row["head_start_step_ms"] = max_over_ranks(ahead, control) * 1e3
        # the host's time to issue each part while the sleep keeps the device behind it
        row["host_ms"] = {part: max_over_ranks([h[i] for h in host], control) * 1e3
                          for i, part in enumerate(("forward", "backward", "optimizer"))}
    return row


def max_over_ranks(times: list, control) -> float:
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=control)
    return float(median)


def run_variant(variant: str, tokens: int, optimizer: str, args, device, dtype,
                control) -> dict:
    import infini_dist
    import infini_dist.compile as idc
    torch._dynamo.reset()
    model = TrainDecoder(args.model, dist.group.WORLD, device, dtype)  # seeded: same weights
    floor = collective_free.CollectiveFree()
    types = infini_dist.config.custom_op_fusion_types
    # the whole variant under its settings: the sites look their executors up by them
    with infini_dist.config.patch(benchmark_cuda_graphs=variant != "infini_dist_eager_timing",
                                  backward_sites=variant != "infini_dist_forward_overlap",
                                  matmul_prologue=True if variant == MATMUL
                                  else infini_dist.config.matmul_prologue,
                                  custom_op_fusion_types=types + ("overlap",) * (
                                      variant == WGRAD)):
        counted = None  # (sites, sites left native, recompiles) of the compile timed
        if variant == "inductor":
            forward = torch.compile(model)
        elif variant == "inductor_overlap":
            forward = torch.compile(model, options=OVERLAP)
        elif variant == FLOOR:
            forward = collective_free.compile_model(model, floor)
        else:
            forward, counted = decide_then_recompile(
                model, tokens, args, device, dtype, control,
                OVERLAP if variant.endswith("_overlap") else None)
        sites_before, native_before = idc.stats["sites"], idc.stats["native_sites"]
        row = train_curve(model, forward, tokens, optimizer, args, device, dtype, control)
        if counted is None:  # compiled in its first step
            counted = (idc.stats["sites"] - sites_before,
                       idc.stats["native_sites"] - native_before, None)
        # the IR ops of each kind of site that ran under this variant, forward and backward
        ran = idc.decisions(infini_dist.config.snapshot()) \
            if variant not in ("inductor", "inductor_overlap", FLOOR) else []
    row.update(variant=variant, tokens=tokens, optimizer=optimizer,
               sites=counted[0], native_sites=counted[1], recompiles=counted[2],
               site_ops=sorted({d["op"] for d in ran}),
               # each tuned site's committed choice and every choice's time (max over ranks)
               decided=[{"op": d["op"], "choice": d["choice"], "times_us": {
                   name: round(t * 1e6, 1) for name, t in d.get("times_s", {}).items()}}
                        for d in ran])
    if variant == FLOOR:
        row.update(floor.counts())
    return row


def compare(rows: list, tol: float) -> list:
    """Per tokens-per-step, optimizer and variant with the pass: its speedup over inductor, its
    step over the collective-free step (when that ran) and the loss curves' distance. The
    floor's own verdict: no collective left in its graphs."""
    verdicts = []
    for ours in rows:
        if ours["variant"] == "inductor":
            continue
        same = [r for r in rows if (r["tokens"], r["optimizer"]) == (ours["tokens"],
                                                                     ours["optimizer"])]
        base = next(r for r in same if r["variant"] == "inductor")
        floor = next((r for r in same if r["variant"] == FLOOR), None)
        # the user's best plain path, where Inductor's overlap ran too: never slower than it
        best = min((r for r in same if r["variant"] in ("inductor", "inductor_overlap")),
                   key=lambda r: r["step_ms"])
        verdict = {"tokens": ours["tokens"], "optimizer": ours["optimizer"],
                   "variant": ours["variant"], "speedup": base["step_ms"] / ours["step_ms"],
                   "speedup_over_best_plain": best["step_ms"] / ours["step_ms"],
                   "over_floor": ours["step_ms"] / floor["step_ms"] if floor else None,
                   "inductor_over_floor": base["step_ms"] / floor["step_ms"] if floor else None}
        if ours["variant"] == FLOOR:  # partial sums: a curve of its own, nothing to compare
            verdict.update(loss_rel_diff=None, loss_ok=ours["collectives_left"] == 0)
        else:
            diff = max(abs(a - b) / max(abs(b), 1e-12)
                       for a, b in zip(ours["losses"], base["losses"]))
            verdict.update(loss_rel_diff=diff, loss_ok=diff <= tol)
        verdicts.append(verdict)
    return verdicts


def table(rows: list, verdicts: list) -> str:
    lines = ["| tokens/step | AdamW | variant | step ms | tokens/s | sites | left native | "
             "final loss |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['optimizer']} | {r['variant']} | "
                     f"{r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['sites']} | "
                     f"{r['native_sites']} | {r['losses'][-1]:.5f} |")
    ahead = [r for r in rows if "head_start_step_ms" in r]
    if ahead:
        def over_floor(r) -> str:  # the device's step over the floor's, where the floor ran
            floor = next((f for f in ahead if f["variant"] == FLOOR and
                          (f["tokens"], f["optimizer"]) == (r["tokens"], r["optimizer"])), None)
            return f"{r['head_start_step_ms'] / floor['head_start_step_ms']:.3f}" if floor else ""
        lines += ["", "| tokens/step | AdamW | variant | step ms | with a head start, less "
                      "it (the device's step) | over the floor's | host stalls in the step | "
                      "host ms: forward / backward / optimizer | site calls a step launched "
                      "from C++ |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['tokens']} | {r['optimizer']} | {r['variant']} | {r['step_ms']:.2f} | "
                  f"{r['head_start_step_ms']:.2f} | {over_floor(r)} | "
                  f"{r['step_ms'] - r['head_start_step_ms']:.2f} | " +
                  " / ".join(f"{t:.2f}" for t in r["host_ms"].values()) +
                  f" | {r['cpp_launches_per_step']:.1f} |" for r in ahead]
    lines += ["", f"| tokens/step | AdamW | variant | speedup over inductor (over the faster "
                  f"of inductor, inductor_overlap) | step / "
                  f"collective-free (target <= {TARGET} at 2048; inductor's) | loss curve max "
                  f"rel diff | ok |", "|---|---|---|---|---|---|---|"]
    for v in verdicts:
        floor = "" if v["over_floor"] is None else \
            f"{v['over_floor']:.3f} ({v['inductor_over_floor']:.3f})"
        diff = "not compared" if v["loss_rel_diff"] is None else f"{v['loss_rel_diff']:.2e}"
        lines.append(f"| {v['tokens']} | {v['optimizer']} | {v['variant']} | "
                     f"{v['speedup']:.3f}x ({v['speedup_over_best_plain']:.3f}x) | {floor} | "
                     f"{diff} | "
                     f"{'yes' if v['loss_ok'] else 'NO'} |")
    return "\n".join(lines)


def add_arguments(parser):
    parser.add_argument("--out", default="bench_train_out")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=nonempty_ints, default="2048,8192",
                        help="tokens per step, comma-separated")
    parser.add_argument("--variants", type=names(VARIANTS),
                        default=f"inductor,inductor_overlap,infini_dist,infini_dist_overlap,"
                                f"infini_dist_forward_overlap,{FLOOR}",
                        help=f"comma-separated, among {','.join(VARIANTS)} (inductor always runs)")
    parser.add_argument("--optimizers", type=names(OPTIMIZERS), default="foreach",
                        help="AdamW implementations, each timed with every variant: foreach, "
                             "fused")
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="untimed first steps")
    parser.add_argument("--lr", type=positive_float, default=1e-4)
    parser.add_argument("--tol", type=positive_float, default=None,
                        help="loss curves' max relative difference (default 2e-2 bf16, 1e-4 fp32)")
    parser.add_argument("--one-rank-symm", action="store_true",
                        help="offer the symmetric-memory kernels at one rank (one GPU: the "
                             "pass's device-side cost without communication)")
    parser.add_argument("--head-start-ms", type=positive_float, default=None,
                        help="also time each variant's steps behind a sleep kernel of this "
                             "length, less the sleep: the step with host stalls hidden")
    add_matmul_prologue(parser)
    add_model_sizes(parser, layers=4)


def finish(parser, args, world):
    if args.steps <= args.warmup:
        parser.error("--steps must be greater than --warmup")
    args.variants = [v for v in VARIANTS if v in {*args.variants, "inductor"}]
    args.model = ModelConfig(args.layers, args.hidden, args.mlp, args.heads, args.kv_heads,
                             context=max(args.tokens))
    usage_error(parser, check_shapes, args.model, world)
    args.cpu_smoke = args.device == "cpu"  # job.setup: gloo, float32


def parse_args(argv=None):
    args = parse(argv, add_arguments, finish, prog="infini-dist bench --train",
                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if args.one_rank_symm:  # in this process only: the CLI checks arguments without it
        from infini_dist.launch.bench_eager import allow_one_rank
        allow_one_rank()
    return args


def main(argv=None) -> int:
    import infini_dist
    args = parse_args(argv)
    if args.matmul_prologue is not None:
        infini_dist.config.matmul_prologue = args.matmul_prologue
    device, dtype, control = setup(args)
    tol = args.tol if args.tol is not None else (2e-2 if dtype == torch.bfloat16 else 1e-4)
    rows = [run_variant(v, tokens, optimizer, args, device, dtype, control)
            for tokens in args.tokens for optimizer in args.optimizers for v in args.variants]
    verdicts = compare(rows, tol)
    if dist.get_rank() == 0:
        text = table(rows, verdicts)
        print(text, flush=True)
        os.makedirs(args.out, exist_ok=True)
        meta = {"world_size": dist.get_world_size(), "model": asdict(args.model),
                "dtype": str(dtype).replace("torch.", ""), "steps": args.steps,
                "warmup": args.warmup, "lr": args.lr, "tol": tol, "torch": torch.__version__,
                "matmul_prologue": infini_dist.config.matmul_prologue,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "verdicts": verdicts}, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text + "\n")
    shutdown()
    return 0 if all(v["loss_ok"] for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
