"""The demo: a small tensor-parallel transformer block with recursive fusion on.

Run under torchrun (`infini-dist demo` starts it). Each row-parallel projection ends in an
all_reduce followed by residual add + RMSNorm, and the MLP ends in relu*scale. The block runs
once through the plain torch path (the unfused reference) and once through infini_dist; per fused
site it prints the candidates, their times (max over ranks), the committed choice and the error.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import infini_dist
from infini_dist.launch import shutdown
from infini_dist.launch.arguments import parse, positive_int
from infini_dist.scheduler.cache import DECISIONS


class TPBlock(nn.Module):
    """Attention (one head group per rank) + MLP; each rank holds 1/world of every projection."""

    def __init__(self, hidden: int, heads_per_rank: int, mlp: int, world: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        head_dim = hidden // (heads_per_rank * world)
        local = heads_per_rank * head_dim

        def weight(*shape):
            return nn.Parameter(torch.randn(*shape, generator=gen) / math.sqrt(shape[-1]))
        self.heads, self.head_dim = heads_per_rank, head_dim
        self.qkv = weight(3 * local, hidden)          # column-parallel
        self.out = weight(hidden, local)              # row-parallel: partial sums
        self.up = weight(mlp // world, hidden)        # column-parallel
        self.down = weight(hidden, mlp // world)      # row-parallel
        self.norm = nn.Parameter(1.0 + 0.1 * torch.randn(hidden, generator=gen))
        self.mlp_scale = 0.5

    def attention(self, x):
        q, k, v = F.linear(x, self.qkv).chunk(3, dim=-1)
        tokens = x.shape[0]
        q, k, v = (t.view(tokens, self.heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(o.transpose(0, 1).reshape(tokens, -1), self.out)

    def forward(self, x, residual, fused: bool = True, errors=None, group=None):
        partial = self.attention(x)
        h, new_residual = self.add_norm(partial, residual, fused, errors, group)
        down = F.linear(F.relu(F.linear(h, self.up)), self.down)
        return self.relu_scale(down, fused, errors, group), new_residual

    def add_norm(self, partial, residual, fused, errors, group):
        plain = _plain_add_norm(partial, residual, self.norm, group)
        if not fused:
            return plain
        out = infini_dist.ops.all_reduce_add_rms_norm(partial, residual, self.norm, group=group)
        _track(errors, "all_reduce_add_rms_norm", out, plain)
        return out

    def relu_scale(self, down, fused, errors, group):
        plain = torch.relu(_all_reduce(down, group)) * self.mlp_scale
        if not fused:
            return plain
        out = infini_dist.ops.all_reduce_relu_scale(down, self.mlp_scale, group=group)
        _track(errors, "all_reduce_relu_scale", (out,), (plain,))
        return out


def _all_reduce(x, group):
    return funcol.all_reduce(x, "sum", (group or dist.group.WORLD).group_name)


def _plain_add_norm(partial, residual, weight, group):
    """The unfused torch path a TP model runs today."""
    residual = _all_reduce(partial, group) + residual
    h = F.rms_norm(residual.float(), (residual.shape[-1],), weight.float(), eps=1e-6)
    return h.to(residual.dtype), residual


def _track(errors, name, fused, plain):
    if errors is not None:
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused, plain))
        errors[name] = max(errors.get(name, 0.0), err)


def report(rows, errors, rank):
    if rank != 0:
        return
    for row in rows:
        print(f"\nsite {row['op']}  ({'from the cache' if row['source'] == 'cache' else 'tuned'})")
        times = row.get("times_s", {})
        width = max([len(n) for n in times] + [10])
        print(f"  {'candidate':<{width}}  time us (max over ranks)")
        for name, seconds in sorted(times.items(), key=lambda kv: kv[1]):
            mark = "  <- committed" if name == row["choice"] else ""
            print(f"  {name:<{width}}  {seconds * 1e6:10.1f}{mark}")
        print(f"  committed: {row['choice']}   max |fused - unfused| = "
              f"{errors.get(row['op'], float('nan')):.3e}")


def add_arguments(parser):
    parser.add_argument("--tokens", type=positive_int, default=16)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="run the plain model through torch.compile with the infini_dist pass")


def finish(parser, args, world):
    if args.hidden < 2 * world:  # TPBlock: 2 heads per rank, each at least one wide
        parser.error(f"--hidden {args.hidden} must be at least 2 heads x {world} ranks")


def main(argv=None):
    args = parse(argv, add_arguments, finish, description="infini_dist demo (run under torchrun)")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = [TPBlock(args.hidden, 2, 4 * args.hidden, world, seed=1000 * i + rank)
              .to(device, dtype) for i in range(args.layers)]
    gen = torch.Generator().manual_seed(0)  # activations are replicated across TP ranks
    x0 = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)

    errors: dict[str, float] = {}

    def forward(fused):
        x, residual = x0, x0
        for layer in layers:
            x, residual = layer(x, residual, fused=fused, errors=errors if fused else None)
        return x, residual

    with torch.no_grad():
        reference = forward(fused=False)
        if args.compile:
            from infini_dist.compile import compile_model
            fused_out = compile_model(lambda: forward(fused=False))()
        else:
            fused_out = forward(fused=True)
    error = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused_out, reference))
    scale = max(b.float().abs().max().item() for b in reference)
    relative = error / max(scale, 1e-30)
    if args.compile:
        from infini_dist import compile as fusion_pass
        rows = fusion_pass.decisions()
        # compiled sites have no per-op eager twin: the block-level error is the measure
        errors = {row["op"]: error for row in rows}
    else:
        rows = infini_dist.ops.decisions()
    report(rows, errors, rank)
    if rank == 0:
        if DECISIONS.misses == 0 and DECISIONS.hits > 0:
            print(f"\ncache: all {DECISIONS.hits} site decisions came from the cache in "
                  f"{os.path.expanduser(infini_dist.config.cache_dir)}; nothing was tuned")
        else:
            print(f"\ncache: {DECISIONS.misses} site(s) tuned and saved to "
                  f"{os.path.expanduser(infini_dist.config.cache_dir)}; run again to load them "
                  f"from the cache")
        print(f"world size {world}, {device.type}, {dtype}, tokens {args.tokens}, hidden "
              f"{args.hidden}: block output max error vs unfused {error:.3e} "
              f"({relative:.1e} of the largest value)")
    shutdown()
    # bf16: a couple of roundings at the largest magnitude; fp32: far below that
    if relative > (2e-2 if dtype == torch.bfloat16 else 1e-5):
        raise SystemExit(f"demo: fused output differs from the unfused reference by {error} "
                         f"({relative:.1e} relative)")


if __name__ == "__main__":
    main()
