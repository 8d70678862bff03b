"""Eager `infini_dist.ops.all_reduce_add_rms_norm` calls against a bare NCCL all_reduce
(issue #25: an eager call costs no more than NCCL's, from the first minute on a fresh machine as
well as in a long job), per symmetric-memory choice, with the path that served the calls.

    infini-dist bench --eager --nproc 2 [--tokens 1,16,128] [--first-minute 60]
    torchrun --nproc-per-node=2 -m infini_dist.launch.bench_eager --tokens 1,16,128
    python -m infini_dist.launch.bench_eager --one-rank-symm     # one GPU

µs per call, bf16, hidden 4096, max over ranks:
  host    the CPU time of issuing the calls, while a sleep kernel holds the GPU (no call ever
          waits for the device)
  device  the GPU time of the same calls, run back to back behind that sleep (CUDA events;
          the GPU never waits for the host)
  loop    a plain loop of calls and a synchronize: what a job sees, about max(host, device)
  path    C++ (kernels/express.py's table served every call), Python, or NCCL

The default mode forces each choice through the engine's timing hook, after the C++ path's
build. `--first-minute S` is what a fresh machine's first S seconds look like: the engine's own
choice, the C++ path building in the background as it does for a user (from the import of the
ops at the script's start, before the process group and with no model to load: the shortest
head start a job gives it), the three numbers taken every few seconds from the first call on
(run it with fresh INFINI_DIST_EXPRESS_DIR, INFINI_DIST_CACHE_DIR and TRITON_CACHE_DIR for a
fresh machine's state). `--layers` adds the
host time of each layer below our call, timed alone.

`--one-rank-symm` runs the symmetric-memory kernels on a single rank (the engine offers them
from 2 ranks up): their host path is the same at any world size, only the device work differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import time

import torch
import torch.distributed as dist

from infini_dist.launch.arguments import nonempty_ints, nonnegative_float, parse, positive_int
from infini_dist.launch.bench_patterns import make_inputs

CHOICES = ("one_shot", "two_shot", "one_shot_lamport", "two_shot_lamport",
           "two_shot_polled_gather", "one_shot_lamport_streamed")


SLEEP_CYCLES = 200_000_000  # ~0.1 s at H100/H200 clocks: far longer than issuing the calls


def per_call_us(fn, calls: int = 2000) -> float:
    """Host µs per call of a plain loop (the layers' timing: host-bound, never synchronized)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - begin) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def host_device_loop(fn, calls: int = 200, rounds: int = 3) -> tuple[float, float, float]:
    """(host, device, loop) µs per call, each the median of `rounds`, max over ranks."""
    samples = []
    for _ in range(rounds):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda._sleep(SLEEP_CYCLES)
        begin = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host = (time.perf_counter() - begin) / calls
        end.synchronize()
        device = start.elapsed_time(end) / 1e3 / calls
        dist.barrier()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((host, device, (time.perf_counter() - begin) / calls))
    mine = torch.tensor([sorted(column)[len(column) // 2] * 1e6 for column in zip(*samples)],
                        dtype=torch.float64, device=torch.cuda.current_device())
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return tuple(mine.tolist())


def path_of(built, fn) -> str:
    """Which path served a call of `fn`: C++ when the table's hit count moved."""
    hits = built.hits() if built is not None else 0
    fn()
    return "C++" if built is not None and built.hits() > hits else "Python"


def allow_one_rank() -> None:
    """Offer the symmetric-memory all-reduce kernels at world size 1 too (measurement only:
    their host path and their epilogue work do not depend on the world size)."""
    from infini_dist.scheduler.backends import symm
    plan = symm.plan_span
    symm.plan_span = lambda span, meta, ctx: plan(
        span, meta, dataclasses.replace(ctx, world_size=max(2, ctx.world_size)))


def layers(x, residual, weight) -> list[tuple[str, float]]:
    """Host µs of each layer of the call just made, from the outside in."""
    from infini_dist.scheduler.store import STORE
    runner = STORE.entries["all_reduce_add_rms_norm"].executor.site_runners()[0]
    choice = list(runner._committed.values())[-1]
    values = {"x": x, "residual": residual, "weight": weight}
    rows = [("runner.run", per_call_us(lambda: runner.run(values, None))),
            ("choice.run", per_call_us(lambda: choice.run(values)))]
    prepared = getattr(choice._runner, "prepared", None)
    if prepared is not None:
        written = list(prepared.plan.allocate(x.device, x).values())
        tensors = [values[name] for name in prepared.names]
        launch = prepared.launch
        rows += [("prepared launch", per_call_us(lambda: prepared(values))),
                 ("outputs allocated", per_call_us(
                     lambda: prepared.plan.allocate(x.device, x))),
                 ("FastLaunch", per_call_us(lambda: launch(*tensors, *written)))]
        if launch.fast:
            args = launch._fill(tensors + written)
            stream = launch._get_stream(launch._device)
            rows.append(("compiled launcher", per_call_us(
                lambda: launch._launcher(*args, stream=stream))))
    return rows


def inputs_for(tokens, hidden, device):
    """(x, residual, weight) of the sweep's add_rms_norm case (launch/bench_patterns.py)."""
    values = make_inputs("add_rms_norm", tokens, hidden, torch.bfloat16, device, dist.get_rank())
    return values["x"], values["residual"], values["weight"]


def forced_rows(args, device, built) -> list[tuple]:
    """Per token count, NCCL, then each choice forced (C++ path, and the Python path of it)."""
    import infini_dist
    from infini_dist import ops
    from infini_dist.scheduler.store import STORE
    rows = []
    for index, tokens in enumerate(args.tokens):
        x, residual, weight = inputs_for(tokens, args.hidden, device)
        inplace = x.clone()
        rows.append((tokens, "bare dist.all_reduce (in place)", "NCCL",
                     *host_device_loop(lambda: dist.all_reduce(inplace))))
        call = lambda: ops.all_reduce_add_rms_norm(x, residual, weight)  # noqa: E731
        for number, name in enumerate(CHOICES):
            # settings of their own per row: fresh executors and decision-cache keys
            threshold = 1.0 + 1e-6 * (1 + 10 * index + number)
            with infini_dist.config.patch(fusion_speedup_threshold=threshold):
                STORE.timing_hook = lambda medians, p=name: {
                    n: 0.5 if n.startswith(p + "[") and n.endswith("e1]") else 2.0
                    for n in medians}
                call()
                committed = ops.decisions()[-1]["choice"]
                if not committed.startswith(name + "["):
                    rows.append((tokens, f"{name}: not offered ({committed})", "-",
                                 *[float("nan")] * 3))
                    continue
                path = path_of(built, call)
                rows.append((tokens, f"ours, {committed}", path, *host_device_loop(call)))
                if path == "C++":
                    with infini_dist.config.patch(express_ops=False):
                        call()
                        rows.append((tokens, "  same, express_ops=False", "Python",
                                     *host_device_loop(call)))
                if args.layers:
                    rows += [(tokens, f"  {label}", "", us, float("nan"), float("nan"))
                             for label, us in layers(x, residual, weight)]
        STORE.timing_hook = None
    return rows


def first_minute_rows(args, device, began: float) -> list[tuple]:
    """The engine's own choice from the first call on, every few seconds until `args.first_minute`
    seconds have passed since the process began, the C++ path building in the background."""
    from infini_dist import ops
    from infini_dist.kernels import express
    cases = [(tokens, *inputs_for(tokens, args.hidden, device)) for tokens in args.tokens]
    rows, choice = [], {}
    while True:
        for tokens, x, residual, weight in cases:
            call = lambda: ops.all_reduce_add_rms_norm(x, residual, weight)  # noqa: E731
            at = time.monotonic() - began
            call()  # the first one tunes
            choice.setdefault(tokens, ops.decisions()[-1]["choice"])
            path = path_of(express.module(), call)
            rows.append((tokens, f"{at:5.1f} s: ours, {choice[tokens]}", path,
                         *host_device_loop(call, calls=100, rounds=1)))
            inplace = x.clone()
            rows.append((tokens, f"{at:5.1f} s: bare dist.all_reduce (in place)", "NCCL",
                         *host_device_loop(lambda: dist.all_reduce(inplace), calls=100,
                                           rounds=1)))
        done = torch.tensor([time.monotonic() - began >= args.first_minute], device=device)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank leaves the loop together
        if done.item():
            return rows
        time.sleep(2.0)


def add_arguments(parser):
    parser.add_argument("--tokens", type=nonempty_ints, default="1,16,128",
                        help="token counts, comma-separated")
    parser.add_argument("--hidden", type=positive_int, default=4096)
    parser.add_argument("--first-minute", type=nonnegative_float, default=0.0, metavar="SECONDS",
                        help="a fresh state's first SECONDS from the first call on (0: each "
                             "choice forced, after the C++ module's build)")
    parser.add_argument("--layers", action="store_true",
                        help="also the host time of each layer below the call")
    parser.add_argument("--one-rank-symm", action="store_true",
                        help="offer the symmetric-memory kernels at one rank (one GPU)")


def finish(parser, args, world):
    if args.one_rank_symm and args.first_minute:
        parser.error("--one-rank-symm forces the choices; --first-minute takes the engine's")


def main(argv=None) -> None:
    began = time.monotonic()
    args = parse(argv, add_arguments, finish, prog="infini-dist bench --eager",
                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if args.first_minute:  # where a user's script imports the ops: at its start, which starts
        importlib.import_module("infini_dist.ops")  # the C++ build on a CUDA machine
    else:  # decisions of its own; the first-minute mode takes the env's
        os.environ.setdefault("INFINI_DIST_CACHE_DIR", "/tmp/infini_dist_eager")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29561", LOCAL_RANK="0")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from infini_dist.kernels import express
    if args.one_rank_symm:
        allow_one_rank()
    with torch.no_grad():
        if args.first_minute:
            rows = first_minute_rows(args, device, began)
        else:
            rows = forced_rows(args, device, express.start(wait=True))
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name()}, world size {dist.get_world_size()}")
        print("| tokens | call | path | host µs | device µs | loop µs |\n|---|---|---|---|---|---|")
        for tokens, label, path, host, dev, loop in rows:
            print(f"| {tokens} | {label} | {path} | {host:.1f} | {dev:.1f} | {loop:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
