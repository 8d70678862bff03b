"""Serial vs parallel tuning: wall time to precompile and tune several sites, under torchrun.

    torchrun --nproc-per-node=2 -m infini_dist.launch.bench_tuning --threads 1 8

Each site (a distinct hidden size) is tuned from scratch once per thread count; the table gives
the precompile phase (what the thread pool speeds up) and the whole tuning, max over ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import infini_dist
from infini_dist.scheduler.cache import DECISIONS
from infini_dist.scheduler.engine import GraphExecutor
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.launch import init_job, shutdown


def site_graph() -> SubGraph:
    return SubGraph((OpNode("scale", ("x",), ("xs",), {"scale": 0.5}),
                     OpNode("all_reduce", ("xs",), ("y",)),
                     OpNode("add", ("y", "residual"), ("h",)),
                     OpNode("rms_norm", ("h", "weight"), ("n",)),
                     OpNode("relu", ("n",), ("out",))), ("x", "residual", "weight"), ("out", "h"))


def tune_all(hiddens, tokens, device, dtype) -> tuple[float, float, int]:
    precompile = tuning = 0.0
    candidates = 0
    for hidden in hiddens:
        DECISIONS.clear()
        executor = GraphExecutor(site_graph(), infini_dist.config.snapshot())
        gen = torch.Generator().manual_seed(hidden)
        inputs = {"x": torch.randn(tokens, hidden, generator=gen).to(device, dtype),
                  "residual": torch.randn(tokens, hidden, generator=gen).to(device, dtype),
                  "weight": torch.rand(hidden, generator=gen).to(device, dtype) + 0.5}
        executor.run(inputs)
        record = executor.site_runners()[0].last_tuning
        precompile += record["precompile_s"]
        tuning += record["tuning_s"]
        candidates += len(record["candidates"])
    return precompile, tuning, candidates


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--hiddens", type=int, nargs="+", default=[1024, 2048, 3072, 4096])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    device, dtype = init_job()
    rows = []
    for threads in args.threads:
        # Fresh hidden sizes per row, so no kernel compiled for an earlier row is reused.
        hiddens = [h + 8 * threads for h in args.hiddens]
        with infini_dist.config.patch(max_autotune_threads=threads, enable_disk_cache=False,
                                      benchmark_reps=3, benchmark_warmup=1):
            local = tune_all(hiddens, args.tokens, device, dtype)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        worst = (max(g[0] for g in gathered), max(g[1] for g in gathered), gathered[0][2])
        rows.append((threads, *worst))
    if dist.get_rank() == 0:
        print(f"\ntuning {len(args.hiddens)} sites on {dist.get_world_size()} ranks, {device.type}")
        print(f"{'threads':>8} {'choices':>8} {'precompile s':>13} {'tuning s':>9}")
        for threads, precompile, tuning, candidates in rows:
            print(f"{threads:>8} {candidates:>8} {precompile:>13.3f} {tuning:>9.3f}")
    shutdown()


if __name__ == "__main__":
    main()
