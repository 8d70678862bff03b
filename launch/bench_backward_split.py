"""A backward site split by rows (issue #27), before any pass builds it: the input gradient's
GEMM in row parts with its all-reduce as a reduce-scatter under it (the chain's `produce`,
scheduler/split_site.py), then the weight gradient's GEMM beside the all-gather:

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_backward_split \
        [--rows 2048] [--repeat 3]

For the column-parallel linears of a Llama-3-8B layer at TP = world (qkv, gate_up), with G the
output gradient [rows, N], W the weight shard [N, 4096] and x the saved input [rows, 4096]:
  floor    dX = G @ W, then dW = G^T @ x: the GEMMs with no communication
  nccl     dX, NCCL all_reduce(dX), dW
  sites    dX and our synchronous all-reduce + add + RMSNorm (the engine's site), then dW
  split    dX's peers' rows first, each pushed by copy engine while the next part computes;
           this rank's rows, their reduction + add + RMSNorm; then dW on the compute stream
           while the copy engine pushes the reduced rows to the peers; then the gather's wait
The add + RMSNorm stands in for the backward's row-wise epilogue (the norm's backward), which
has the same reads. All but the floor end with a copy of the reduced rows (the split's read).
CUDA-graph replay in lockstep, µs, max over ranks, `--repeat` times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from infini_dist.launch.bench_split_units import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MLP,
                                                   arguments, runner_of, site_text, start,
                                                   worst_times)
from infini_dist.scheduler.split_chain import ChainRunner, ChainSite
from infini_dist.scheduler.split_ways import SITES, SPLIT, Way, Ways


def widths(world: int) -> dict[str, int]:
    """N of the column-parallel linears whose input gradients the backward all-reduces."""
    return {"qkv": (HEADS + 2 * KV_HEADS) * HEAD_DIM // world, "gate_up": 2 * MLP // world}


def backward_site(group_name: str, rows: int, n: int) -> ChainSite:
    """The input gradient's site: dX = G @ W (W [N, hidden] as the linear holds it), its
    all-reduce, add + RMSNorm; no readers (the split's read is a copy of the gathered rows)."""
    return ChainSite(site_text(group_name, False), rows, n, HIDDEN, False, 1e-6, True, ())


def ways(runner: ChainRunner, group, device) -> tuple[list[Way], tuple]:
    """The four ways of the module doc over one random site (Ways' values, never zeros), and
    their operands (G, W, x, dW)."""
    values = Ways(runner, 0, device)
    g, w = values.inputs[:2]
    x = torch.randn(g.shape[0], w.shape[1], device=device, dtype=g.dtype)
    dw = torch.empty(g.shape[1], w.shape[1], device=device, dtype=g.dtype)

    def floor():
        dx = torch.mm(g, w)
        torch.mm(g.t(), x, out=dw)
        return dx

    def nccl():
        dx = torch.mm(g, w)
        dist.all_reduce(dx, group=group)
        torch.mm(g.t(), x, out=dw)
        return dx.clone()

    def site(mode):
        runner.mode = mode
        h = runner.site(0, values.inputs)[0]
        torch.mm(g.t(), x, out=dw)  # split: beside the copy engine's gather
        return runner.read(0, [h])[0]  # split: the gather's wait; the copy stream joins

    return ([Way("floor", floor), Way("nccl", nccl), Way(SITES, lambda: site(SITES)),
             Way(SPLIT, lambda: site(SPLIT))], (g, w, x, dw))


def main(argv=None) -> int:
    args = arguments(argv, __doc__.split("\n")[0], repeat=3)
    rank, world, device, group, settings, plane, ctx = start()
    lines = []
    for name, n in widths(world).items():
        runner = runner_of(backward_site(group.group_name, args.rows, n), group, device,
                           settings, plane)
        choices, _ = ways(runner, group, device)
        outs = {c.name: c.run(None) for c in choices}
        torch.cuda.synchronize(device)
        same = torch.equal(outs[SITES], outs[SPLIT])
        lines.append(f"{name:8s} N {n:6d} | " + worst_times(
            settings, choices, ctx, plane, args.repeat, f"backward split {name}")
            + f" | split's h equals the site's: {same}")
        del choices, runner, outs
    if rank == 0:
        print(f"backward sites at {args.rows} rows, {world} ranks (us, max over ranks, each "
              f"repeat):")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
