"""NCCL's symmetric kernels as a peer of the latency sweep (launch/bench.py), the way a user
turns them on: `symm_mem.set_backend("NCCL")`, the tensor from `symm_mem.empty` and
`rendezvous`, then a plain `dist.all_reduce` on it (NCCL 2.27+ picks its symmetric kernels for a
registered window).

    torchrun --nproc-per-node=2 -m infini_dist.launch.peers_nccl_symm --out OUT [--tokens ...]

The backend cannot change once a symmetric tensor exists, and the sweep allocates torch's own
symmetric tensors (its symm_* peers and our kernels), so these rows come from a process of their
own. `.ci/gpu_suite bench` runs it first, then the sweep on the same machine in the same call,
which merges the rows (`--extra-rows OUT/results.json`). Rows, per pattern and token count, in
the sweep's units (µs per call, max over ranks, graph replay and eager):
  nccl_symm_ar   the all_reduce alone, in place on the registered tensor (as nccl_ar)
  nccl_symm      the input copied into the registered tensor, the all_reduce, then the epilogue
                 in eager torch: the same work as `native`, checked against the fp32 reference
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from infini_dist.launch import shutdown
from infini_dist.launch.arguments import names, nonempty_ints, parse, positive_int
from infini_dist.launch.bench import Timer
from infini_dist.launch.bench_patterns import (PATTERNS, dequantized, eager_epilogue,
                                               make_inputs)
from infini_dist.launch.peers_flashinfer import output_error
from infini_dist.scheduler.benchmark import CALLS_PER_GRAPH


def peers(pattern, inputs, group_name):
    """name -> (callable, reset) on one registered tensor of x's shape."""
    import torch.distributed._symmetric_memory as symm_mem
    x = inputs["x"]
    window = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(window, group_name)

    def same_work():
        window.copy_(x)
        dist.all_reduce(window)
        return eager_epilogue(pattern, window, inputs)
    error = output_error(same_work(), inputs, lambda y, sides: eager_epilogue(pattern, y, sides),
                         None, (lambda outs: dequantized(pattern, outs)) if "fp8" in pattern
                         else None, slack=4.0)  # rounded after each op, as `native` is
    if error is not None:
        raise RuntimeError(f"nccl_symm wrong on {pattern}: {error}")
    return {"nccl_symm_ar": (lambda: dist.all_reduce(window), lambda: window.copy_(x)),
            "nccl_symm": (same_work, lambda: None)}


def add_arguments(parser):
    parser.add_argument("--tokens", type=nonempty_ints, default="1,16,128,1024,8192")
    parser.add_argument("--hidden", type=positive_int, default=4096)
    parser.add_argument("--patterns", type=names(PATTERNS), default=",".join(PATTERNS))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    parser.add_argument("--out", default="nccl_symm_out")
    parser.add_argument("--trials", type=positive_int, default=3)
    parser.add_argument("--replays", type=positive_int, default=20)
    parser.add_argument("--graph-calls", type=positive_int, default=CALLS_PER_GRAPH,
                        help="calls captured in each CUDA graph: as the sweep it joins")


def main(argv=None):
    args = parse(argv, add_arguments, lambda *_: None, description=__doc__.split("\n")[0])
    import torch.distributed._symmetric_memory as symm_mem
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    symm_mem.set_backend("NCCL")  # before any symmetric tensor of this process
    dist.init_process_group("nccl", device_id=device)
    timer = Timer(device, args.trials, args.replays, args.graph_calls)
    rows = []
    for pattern in args.patterns:
        for tokens in args.tokens:
            inputs = make_inputs(pattern, tokens, args.hidden, getattr(torch, args.dtype),
                                 device, dist.get_rank())
            rows += timer.rows(peers(pattern, inputs, dist.group.WORLD.group_name), pattern,
                               tokens)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": {"backend": "NCCL symmetric memory",
                                "world_size": dist.get_world_size(),
                                "graph_calls": args.graph_calls, "replays": args.replays,
                                "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
                       "rows": rows}, f, indent=1)
        for row in rows:
            print(f"{row['pattern']:24s} {row['tokens']:6d} {row['impl']:14s} "
                  + " ".join(f"{m} {row[m + '_us']:.1f}" if m + "_us" in row
                             else f"{m} {row.get(m + '_error', '-')}" for m in ("graph", "eager")))
    shutdown()


if __name__ == "__main__":
    main()
