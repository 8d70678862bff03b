"""Sequence parallelism timed: torch's TP-tutorial plan, forward and training step (issue #26).

    torchrun --nproc-per-node=2 -m infini_dist.launch.bench_sp --out bench_sp_out \\
        [--tokens 2048,8192 --layers 2 --hidden 4096 --mlp 14336 --head-dim 128 --rounds 5
         --iters 10 --steps 5 --force symm_scatter_gather --profile]
    torchrun --nproc-per-node=2 -m infini_dist.launch.bench_sp --cpu-smoke   (gloo, float32)

The model is launch/sp_model.py's decoder, sharded as torch's TP tutorial shards Llama 2: every
layer's forward holds reduce_scatter -> add + RMSNorm -> all_gather twice, the sites that
symm_scatter_gather and one_shot_scatter_gather run in one launch each. Per --tokens (batch 1,
the sequence sharded over the ranks), each variant is compiled afresh from the same weights:

  inductor         torch.compile(model): the user's own path, NCCL collectives
  infini_dist      infini_dist.compile.compile_model(model): the engine's pick at each site, or
                   with --force ALG the engine made to commit ALG wherever it can (a timing hook:
                   every choice is still built, tuned and checked; ALG's timings win)
                   With --eager-timing the engine times each choice as an eager call, host cost
                   included (benchmark_cuda_graphs off: these graphs run without CUDA graphs),
                   instead of under CUDA-graph replay. A process of its own, as --force is:
                   Dynamo shares one compiled entry between two compile_model() calls.
  collective_free  torch.compile with every collective a no-op (launch/collective_free.py): the
                   floor no communication can beat; its outputs are not checked

  forward   no_grad calls, each between two CUDA events, and the host time of a call
            (perf_counter, no sync: a step is host-bound where the two meet); relative L2
            error against the sharded eager model's output; --profile adds the top ops of one
            call by host and device time (rank 0)
  train     forward, MSE against a fixed target, backward, AdamW: after --warmup steps, the
            loss curve of every step must match inductor's within --tol

Every variant is compiled and warmed up first; then all are timed in --rounds interleaved rounds
(--iters forward calls or --steps training steps each), one variant later each round: a time
is the median of its round medians, max over ranks, with its spread (largest over smallest
round median). Host-bound steps drift within a process; timing variants in blocks one after
the other charged that drift to whichever ran first.

A forced algorithm is a process of its own (the engine keeps its decisions for the process):
.ci/gpu_suite sp runs the four processes. Exit status 1 when an output or loss curve is off.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import statistics
import time

import torch
import torch.distributed as dist

from infini_dist.launch import collective_free, shutdown
from infini_dist.launch.arguments import names, nonempty_ints, parse, positive_float, positive_int
from infini_dist.launch.bench_model import Bench, error_text
from infini_dist.launch.job import dynamo_compiles, setup
from infini_dist.launch.model_report import FLOOR
from infini_dist.launch.sp_report import compare, table
from infini_dist.scheduler.benchmark import time_reps

VARIANTS = ("inductor", "infini_dist", FLOOR)
ALGORITHMS = ("symm_scatter_gather", "one_shot_scatter_gather")


def prefer(algorithm: str):
    """An engine timing hook: `algorithm` wins, the deeper its fusion the better; native loses
    to everything (a choice's name ends in [pP,eE], its prologue and epilogue depths)."""
    def hook(medians: dict) -> dict:
        def time_of(name):
            if name == "native":
                return 10.0
            depth = re.search(r"\[p\d+,e(\d+)\]", name)
            mine = name.startswith(algorithm)
            return (5.0 if mine else 9.0) - (0.1 * int(depth.group(1)) if depth else 0.0)
        return {n: time_of(n) for n in medians}
    return hook


def force(algorithm: str) -> None:
    """This process's engine commits `algorithm` wherever it is offered (`prefer`), and keeps
    its decisions off the disk cache both ways: a forced decision is not a measurement, so it
    must not be left for later runs, and a decision an earlier process left there (under the
    same key: the hook is not a setting) would be loaded instead of tuned, so the forced
    algorithm would never be timed. (Session 18's forced one_shot_scatter_gather run loaded
    the symm_scatter_gather process's decisions that way.)"""
    import infini_dist
    from infini_dist.scheduler.store import STORE
    infini_dist.config.enable_disk_cache = False
    STORE.timing_hook = prefer(algorithm)


SETTLE_ROUNDS = 3  # untimed rounds at most, before the timed ones


class Run:
    """One process's variants at each --tokens: the same full weights, sharded afresh each time."""

    def __init__(self, args, device, dtype, control):
        from torch.distributed.device_mesh import init_device_mesh
        self.args, self.device, self.dtype = args, device, dtype
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # bench --model's: sync, the max over ranks, agreed errors, the floor's pass, rel L2
        self.bench = Bench(args, device, control, capture=False)
        self.full = self._full_model()

    def _full_model(self):
        from infini_dist.launch import sp_model
        torch.manual_seed(0)  # the same full weights on every rank
        with torch.device(self.device):
            full = sp_model.Model(self.args.layers, self.args.hidden, self.args.mlp,
                                  self.args.head_dim)
        return full.to(self.dtype)

    def sharded(self):
        from infini_dist.launch import sp_model
        return sp_model.shard(copy.deepcopy(self.full), self.mesh)

    def data(self, tokens: int):
        """(input shard, target shard): the full tensors are the same on every rank."""
        g = torch.Generator(device=self.device).manual_seed(tokens)
        shape = (1, tokens, self.args.hidden)
        x = torch.randn(shape, generator=g, device=self.device).to(self.dtype)
        target = torch.randn(shape, generator=g, device=self.device)
        rank, world = dist.get_rank(), dist.get_world_size()
        return (x.chunk(world, dim=1)[rank].contiguous(),
                target.chunk(world, dim=1)[rank].contiguous())

    def compiled(self, variant: str, model):
        # no torch._dynamo.reset() here: every variant's compiled code stays for the rounds
        import infini_dist.compile as idc
        if variant == "inductor":
            return torch.compile(model)
        if variant == FLOOR:
            return collective_free.compile_model(model, self.bench.floor)
        return idc.compile_model(model)

    @contextlib.contextmanager
    def settings(self, variant: str):
        """The variant's engine settings, around each of its calls: its sites look their
        executors up by them."""
        import infini_dist
        eager = variant == "infini_dist" and self.args.eager_timing
        with infini_dist.config.patch(benchmark_cuda_graphs=not eager):
            yield

    def guarded(self, what: str, fn):
        """fn()'s result, or (None, the first rank's error) when it fails on any rank."""
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a table entry, the run goes on
            error = error_text(exc)
        first = self.bench.agree(error)
        return (None, f"{what}: {first}") if first else (result, None)

    def prepare(self, variant: str, kind: str, tokens: int, reference):
        """(row, call): the variant compiled, its first call (compile, tuning) and warm-up done;
        call() runs one more forward, or one more training step. call is None on an error."""
        x, target = self.data(tokens)
        model = self.sharded()
        fn = self.compiled(variant, model)
        row = {"variant": variant, "tokens": tokens, "kind": kind}
        if kind == "forward":
            def call():
                with torch.no_grad():
                    return fn(x)
            warmup = 3
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.args.lr)
            row["losses"] = []

            def call():
                loss = torch.nn.functional.mse_loss(fn(x).float(), target)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                row["losses"].append(loss.detach())
            warmup = self.args.warmup - 1

        def first():
            with self.settings(variant):
                begin = time.perf_counter()
                out = call()
                self.bench.sync()
                row["first_call_s"] = time.perf_counter() - begin
                for _ in range(warmup):
                    call()
            return out
        out, error = self.guarded(kind, first)
        if error:
            row["error"] = error
            return row, None
        if kind == "forward" and variant != FLOOR:
            row["rel_l2_vs_eager"] = self.bench.rel_l2(out, reference)
        return row, call

    def profile(self, row: dict, call) -> None:
        """The top ops of one call, by host and by device time, printed on rank 0."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.bench.cuda else [])
        self.bench.sync()
        with self.settings(row["variant"]), profile(activities=activities) as prof:
            call()
            self.bench.sync()
        if dist.get_rank() == 0:
            what = f"{row['tokens']} {row['kind']} {row['variant']}"
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                              max_name_column_width=60)
            print(f"-- profile {what}, by host time --\n{table}", flush=True)
            if self.bench.cuda:
                table = prof.key_averages().table(sort_by="self_device_time_total",
                                                  row_limit=10, max_name_column_width=60)
                print(f"-- by device time --\n{table}", flush=True)

    def one_round(self, row: dict, call) -> tuple[float, float | None]:
        """(median device-side seconds of this round's calls, median host seconds or None)."""
        count = self.args.iters if row["kind"] == "forward" else self.args.steps
        with self.settings(row["variant"]):
            step = statistics.median(time_reps(call, self.device, 0, count))
            if row["kind"] != "forward":
                return step, None
            self.bench.sync()
            host = []
            for _ in range(count):  # no sync: where the host is the bound, these meet the step
                begin = time.perf_counter()
                call()
                host.append(time.perf_counter() - begin)
            return step, statistics.median(host)

    def time_rounds(self, entries: list) -> None:
        """Every prepared (row, call) timed in --rounds interleaved rounds, each round starting
        one variant later: a step's time is the median of its round medians (max over ranks),
        its spread the largest over the smallest round median. A process's host state drifts
        (compile workers winding down, clocks); sequential blocks would charge it to one
        variant."""
        entries = [(row, call) for row, call in entries if call is not None]
        # Untimed rounds first, until one compiles nothing on any rank: a variant's recompile
        # once its sites decide drops the code its class shares with the others
        # (compile/recompile.py), also the code of variants that ran before it in the round,
        # and they compile again here, not inside a timed round.
        for _ in range(SETTLE_ROUNDS):
            before = dynamo_compiles()
            for row, call in entries:
                if "error" in row:
                    continue
                _, error = self.guarded("settle", lambda: self.one_round(row, call))
                if error:
                    row["error"] = error
            if not self.bench.worst(float(dynamo_compiles() - before)):
                break
        entries = [(row, call) for row, call in entries if "error" not in row]
        medians = {id(row): ([], []) for row, _ in entries}
        for r in range(self.args.rounds):
            for i in range(len(entries)):
                row, call = entries[(i + r) % len(entries)]
                if "error" in row:
                    continue
                before = dynamo_compiles()
                result, error = self.guarded("timing", lambda: self.one_round(row, call))
                row["compiles_while_timed"] = (row.get("compiles_while_timed", 0)
                                               + dynamo_compiles() - before)
                if error:
                    row["error"] = error
                    continue
                medians[id(row)][0].append(result[0])
                if result[1] is not None:
                    medians[id(row)][1].append(result[1])
        for row, call in entries:
            steps, hosts = medians[id(row)]
            if "error" in row:
                continue
            row["ms"] = self.bench.worst(statistics.median(steps)) * 1e3
            row["spread"] = self.bench.worst(max(steps) / min(steps))
            if hosts:
                row["host_ms"] = self.bench.worst(statistics.median(hosts)) * 1e3
            if self.args.profile and row["kind"] == "forward":
                self.profile(row, call)

    def tokens(self, tokens: int) -> list[dict]:
        import infini_dist
        import infini_dist.compile as idc
        x, _ = self.data(tokens)
        with torch.no_grad():
            reference = self.sharded()(x)
        entries = []
        for variant in self.args.variants:
            for kind in self.args.kinds:
                sites = idc.stats["sites"]
                row, call = self.prepare(variant, kind, tokens, reference)
                if variant == "infini_dist":
                    row["sites"] = idc.stats["sites"] - sites
                entries.append((row, call))
        self.time_rounds(entries)
        rows = [row for row, _ in entries]
        for row in rows:
            if "losses" in row:
                row["losses"] = [float(v) for v in row["losses"]]
            if row["variant"] == "infini_dist":
                with self.settings(row["variant"]):  # the decisions under its settings
                    chosen = sorted({d["choice"] for d in
                                     idc.decisions(infini_dist.config.snapshot())})
                row["chosen"] = chosen
                if self.args.force:  # a forced algorithm the engine never offered here
                    row["forced_taken"] = any(c.startswith(self.args.force) for c in chosen)
            if dist.get_rank() == 0:
                print(f"{tokens:6d} {row['kind']:8s} {row['variant']:24s} " + (
                    f"{row['ms']:9.3f} ms (spread {row['spread']:.2f})" if "ms" in row
                    else row["error"]) + (
                    f" host {row['host_ms']:.3f} ms" if "host_ms" in row else "") + (
                    f" [{self.args.force} never offered]" if row.get("forced_taken") is False
                    else ""), flush=True)
        return rows


def add_arguments(parser):
    parser.add_argument("--tokens", type=nonempty_ints, default="2048,8192",
                        help="sequence lengths (batch 1), each divisible by the ranks")
    for flag, default in (("layers", 2), ("hidden", 4096), ("mlp", 14336), ("head-dim", 128)):
        parser.add_argument(f"--{flag}", type=positive_int, default=default)
    parser.add_argument("--variants", type=names(VARIANTS), default=",".join(VARIANTS))
    parser.add_argument("--kinds", type=names(("forward", "train")), default="forward,train")
    parser.add_argument("--force", choices=ALGORITHMS, default=None,
                        help="make the engine commit this algorithm wherever it can")
    parser.add_argument("--eager-timing", action="store_true",
                        help="the engine times its choices as eager calls, host cost included")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="interleaved timing rounds over the variants")
    parser.add_argument("--iters", type=positive_int, default=10,
                        help="timed forward calls per round")
    parser.add_argument("--steps", type=positive_int, default=5,
                        help="timed training steps per round")
    parser.add_argument("--warmup", type=positive_int, default=5,
                        help="untimed first training steps (the first compiles and tunes)")
    parser.add_argument("--lr", type=positive_float, default=1e-4)
    parser.add_argument("--tol", type=positive_float, default=None,
                        help="max relative error (default 5e-2 bf16, 1e-4 fp32)")
    parser.add_argument("--profile", action="store_true",
                        help="print one forward call's top ops per variant (rank 0)")
    parser.add_argument("--out", default="bench_sp_out")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="gloo CPU ranks, float32, a tiny model: checks the script itself")


def finish(parser, args, world):
    args.variants = [v for v in VARIANTS if v in {*args.variants, "inductor"}]
    args.kinds = [k for k in ("forward", "train") if k in args.kinds]
    if args.cpu_smoke:
        args.layers, args.hidden, args.mlp, args.head_dim = 1, 32, 64, 8
        args.tokens = [t for t in args.tokens if t <= 64] or [16]
    if args.hidden % args.head_dim or (args.hidden // args.head_dim) % world:
        parser.error(f"--hidden / --head-dim heads must divide over {world} ranks")
    if args.mlp % world or any(t % world for t in args.tokens):
        parser.error(f"--mlp and every --tokens must be divisible by {world} ranks")
    if args.tol is None:
        args.tol = 1e-4 if args.cpu_smoke else 5e-2


def main(argv=None) -> int:
    args = parse(argv, add_arguments, finish, prog="bench_sp", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    started = time.perf_counter()
    device, dtype, control = setup(args)
    if args.force:
        force(args.force)
    run = Run(args, device, dtype, control)
    if dist.get_rank() == 0:
        print(f"TP/SP={dist.get_world_size()} {device.type} {dtype}: layers {args.layers}, "
              f"hidden {args.hidden}, mlp {args.mlp}, head_dim {args.head_dim}; "
              f"force {args.force}", flush=True)
    rows = []
    for tokens in args.tokens:
        rows += run.tokens(tokens)
    failures = compare(rows, args.tol)
    if dist.get_rank() == 0:
        text = table(rows, args.force, args.eager_timing)
        os.makedirs(args.out, exist_ok=True)
        meta = {"world_size": dist.get_world_size(), "dtype": str(dtype).replace("torch.", ""),
                "force": args.force, "eager_timing": args.eager_timing, "layers": args.layers,
                "hidden": args.hidden,
                "mlp": args.mlp, "head_dim": args.head_dim, "rounds": args.rounds,
                "iters": args.iters, "steps": args.steps, "warmup": args.warmup, "tol": args.tol,
                "torch": torch.__version__, "floor": run.bench.floor.counts(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "wall_s": time.perf_counter() - started}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "failures": failures}, f, indent=1)
        print(f"\n{text}\n" + ("\n".join(f"FAILED {m}" for m in failures) or "all checks passed")
              + f"\n{meta['wall_s']:.0f}s in all", flush=True)
    shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
