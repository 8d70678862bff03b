"""Host time of an eager `infini_dist.ops.all_reduce_add_rms_norm` call against a bare NCCL
all_reduce (issue #15: an eager call should cost no more host time than NCCL's), per
symmetric-memory choice, and where the time goes inside our call.

    torchrun --nproc-per-node=2 -m infini_dist.launch.bench_eager_host --tokens 1,16,128
    python -m infini_dist.launch.bench_eager_host --one-rank-symm     # one GPU

µs per call, the best of 5 rounds of 2000 calls (host time: the GPU work is tiny and never
waited for), bf16, hidden 4096, rank 0. Each row forces one choice through the engine's timing
hook. The layers below the full call are timed by calling each one directly with the same
inputs: the engine's runner (decision lookup), the choice, the prepared launch, the
allocation of the outputs and the compiled kernel's launcher alone.

`--one-rank-symm` runs the symmetric-memory kernels on a single rank (the engine offers them
from 2 ranks up): their host path is the same at any world size, only the device work differs,
so one GPU measures it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist

CHOICES = ("one_shot", "two_shot", "one_shot_lamport", "two_shot_lamport",
           "two_shot_polled_gather")


def per_call_us(fn, calls: int = 2000) -> float:
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--one-rank-symm", action="store_true")
    parser.add_argument("--no-layers", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("INFINI_DIST_CACHE_DIR", "/tmp/infini_dist_eager_host")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29561", LOCAL_RANK="0")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    import infini_dist
    from infini_dist import ops
    from infini_dist.scheduler import engine
    from infini_dist.kernels import express
    if args.one_rank_symm:
        allow_one_rank()
    built = express.start(wait=True)  # the C++ path's build, out of the timed calls
    rows = []
    with torch.no_grad():
        for index, tokens in enumerate(int(t) for t in args.tokens.split(",")):
            x, residual = (torch.randn(tokens, args.hidden, device=device).bfloat16()
                           for _ in range(2))
            weight = (1 + 0.1 * torch.randn(args.hidden, device=device)).bfloat16()
            inplace = x.clone()
            rows.append((tokens, "bare dist.all_reduce (in place)",
                         per_call_us(lambda: dist.all_reduce(inplace))))
            for number, name in enumerate(CHOICES):
                # settings of their own per row: fresh executors and decision-cache keys
                threshold = 1.0 + 1e-6 * (1 + 10 * index + number)
                with infini_dist.config.patch(fusion_speedup_threshold=threshold):
                    engine.timing_hook = lambda medians, p=name: {
                        n: 0.5 if n.startswith(p + "[") and n.endswith("e1]") else 2.0
                        for n in medians}
                    ops.all_reduce_add_rms_norm(x, residual, weight)
                    committed = ops.decisions()[-1]["choice"]
                    if not committed.startswith(name + "["):
                        rows.append((tokens, f"{name}: not offered ({committed})", float("nan")))
                        continue
                    hits = built.hits() if built is not None else 0
                    us = per_call_us(lambda: ops.all_reduce_add_rms_norm(x, residual, weight))
                    fast = built is not None and built.hits() > hits
                    rows.append((tokens, f"ours, {committed}"
                                 + (", C++ path" if fast else ", Python path"), us))
                    if fast:
                        with infini_dist.config.patch(express_ops=False):
                            ops.all_reduce_add_rms_norm(x, residual, weight)
                            rows.append((tokens, "  same, Python path (express_ops=False)",
                                         per_call_us(lambda: ops.all_reduce_add_rms_norm(
                                             x, residual, weight))))
                    if not args.no_layers:
                        rows += [(tokens, f"  {label}", us)
                                 for label, us in layers(x, residual, weight)]
            engine.timing_hook = None
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name()}, world size {dist.get_world_size()}")
        print("| tokens | call | host µs |\n|---|---|---|")
        for tokens, label, us in rows:
            print(f"| {tokens} | {label} | {us:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
