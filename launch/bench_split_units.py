"""A row-split chain's sites, each timed every way the chain times it, and the reader GEMMs'
shapes in the parts the split cuts them into:

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_split_units \
        [--rows 2048] [--repeat 2]

The sites are Llama-3-8B's at TP = world (hidden 4096, MLP 14336, 32 heads, 8 KV heads, head
dim 128), in the two layouts users run:
  hf_o_proj    o_proj's site, its norm read by gate_proj and up_proj apart (transformers)
  hf_down      down_proj's site, its norm read by q_proj, k_proj and v_proj apart
  fused_o_proj / fused_down   the same with gate_up and qkv fused (our TP decoder)
Each site runs as scheduler/split_chain.py's decision runs it (scheduler/split_ways.py: site
by site, split, split_first, the _cols variants), under CUDA-graph replay in lockstep, µs per
site and its readers, max over ranks, `--repeat` times. The GEMM table (rank 0 alone, the same
graph timing): the reader GEMM over all rows, in the split's row parts, and in row parts cut
again by columns (what the _cols variants run), the rows of h = rows x 4096 bf16.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import infini_dist
from infini_dist.launch.arguments import positive_int
from infini_dist.scheduler import benchmark, lockstep
from infini_dist.scheduler.choices import RunContext
from infini_dist.scheduler.control import control_plane
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.split_chain import ChainRunner, ChainSite, chain_text
from infini_dist.scheduler.split_ways import Ways

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def site_text(group_name: str, transpose: bool = True) -> str:
    """The engine's text of a matmul -> all_reduce -> add_rms_norm site, serialized as the pass
    serializes its sites (SubGraph.canonical); transpose: the weight is [N, K]."""
    return SubGraph((OpNode("matmul", ("in0", "in1"), ("v0",), {"transpose_weight": transpose}),
                     OpNode("all_reduce", ("v0",), ("v1",), {"group_name": group_name,
                                                             "op": "sum"}),
                     OpNode("add_rms_norm", ("v1", "in2", "in3"), ("v2", "v3"), {"eps": 1e-6})),
                    ("in0", "in1", "in2", "in3"), ("v2", "v3")).canonical()


def units(group_name: str, rows: int, world: int) -> dict[str, ChainSite]:
    """The four sites (see the module doc), readers as (N, transpose, bias)."""
    text, mlp, q, kv = site_text(group_name), MLP // world, HEADS * HEAD_DIM // world, \
        KV_HEADS * HEAD_DIM // world

    def site(k, *readers):
        return ChainSite(text, rows, k, HIDDEN, True, 1e-6, True,
                         tuple((n, True, False) for n in readers))
    return {"hf_o_proj": site(q, mlp, mlp), "fused_o_proj": site(q, 2 * mlp),
            "hf_down": site(mlp, q, kv, kv), "fused_down": site(mlp, q + 2 * kv)}


def gemm_row(rows: int, n: int, world: int, device) -> dict[str, float]:
    """µs of h @ w.T over all rows, in `world` row parts, and in row parts x 2 column parts."""
    h = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16) * HIDDEN ** -0.5
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    part = rows // world

    def parts(columns):
        for p in range(world):
            r = slice(p * part, (p + 1) * part)
            for c in range(columns):
                cols = slice(c * n // columns, (c + 1) * n // columns)
                torch.mm(h[r], w[cols].t(), out=out[r, cols])

    def timed(fn):
        graph, error = benchmark.capture(fn, device, 3)
        if graph is None:
            raise RuntimeError(error)
        return benchmark.median(benchmark.time_graph(graph, device, 20)) * 1e6
    return {"all rows": timed(lambda: torch.mm(h, w.t(), out=out)),
            "row parts": timed(lambda: parts(1)), "row x 2 column parts": timed(lambda: parts(2))}


def start():
    """(rank, world, device, group, settings, control plane, run context) of a torchrun bench
    over NCCL, one GPU a rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    settings = infini_dist.config.snapshot()
    plane = control_plane(group, settings.tuning_timeout_s)
    return rank, world, device, group, settings, plane, RunContext(group, world, rank, device)


def runner_of(spec: ChainSite, group, device, settings, plane) -> ChainRunner:
    """A one-site chain's runner with its split buffers built."""
    runner = ChainRunner(chain_text(group.group_name, torch.bfloat16, [spec]), settings)
    with plane.lock:
        runner._build(group, device, plane)
    return runner


def worst_times(settings, choices, ctx, plane, repeat: int, label: str) -> str:
    """Every choice timed in lockstep `repeat` times: "name t1/t2/... | ...", µs, each the
    max over ranks."""
    runs = [lockstep.time_choices(settings, choices, None, ctx, plane) for _ in range(repeat)]
    gathered = plane.all_gather(runs, label)
    return " | ".join(f"{c.name} " + "/".join(
        f"{max(g[i][c.name] for g in gathered) * 1e6:.1f}" for i in range(repeat))
        for c in choices)


def arguments(argv, description: str, repeat: int):
    """--rows (2048) and --repeat (`repeat`), the options of a bench of split sites."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=positive_int, default=2048)
    parser.add_argument("--repeat", type=positive_int, default=repeat)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = arguments(argv, __doc__.split("\n")[0], repeat=2)
    rank, world, device, group, settings, plane, ctx = start()
    lines = []
    for name, spec in units(group.group_name, args.rows, world).items():
        runner = runner_of(spec, group, device, settings, plane)
        ways = Ways(runner, 0, device)
        ways.first_run()
        lines.append(f"{name:13s} " + worst_times(settings, ways.choices, ctx, plane,
                                                  args.repeat, f"units {name}"))
        del ways, runner
    if rank == 0:
        print(f"sites at {args.rows} rows, {world} ranks (us, max over ranks, each repeat):")
        print("\n".join(lines))
        print(f"reader GEMMs, {args.rows} x {HIDDEN} bf16 (us, rank 0):")
        readers = sorted({n for s in units("g", args.rows, world).values() for n, _, _ in
                          s.readers})
        for n in readers:
            row = gemm_row(args.rows, n, world, device)
            print(f"  N {n:6d}: " + " | ".join(f"{k} {v:.1f}" for k, v in row.items()))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
