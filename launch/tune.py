"""`infini-dist tune`: warm up every token bucket of a model before serving (under torchrun).

    infini-dist tune --model tp_decoder --tokens 1,8,32,1024 --layers 4 --hidden 4096 ...
    infini-dist tune --model ops --tokens 1,8,32 --hidden 4096

`tp_decoder` is the benchmark's Llama-style TP decoder (launch/tp_decoder.py, random weights)
compiled with the infini_dist pass, dynamic in the token count; each count runs a prefill of that
many tokens, which reaches the same sites as decode at that batch size. `ops` runs the eager fused
ops (all_reduce + add + RMSNorm, all_reduce + SwiGLU) at (tokens, hidden). Decisions go to the
configured cache dir (`INFINI_DIST_CACHE_DIR`), where later jobs load them.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import infini_dist
from infini_dist.launch import init_job, shutdown


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="infini-dist tune", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tp_decoder", "ops"), default="tp_decoder")
    parser.add_argument("--tokens", default="",
                        help="token counts, comma-separated (default: one per bucket)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--backend", choices=("inductor", "infini_dist"), default="inductor",
                        help="tp_decoder's torch.compile backend")
    args = parser.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()] or None
    except ValueError:
        parser.error(f"--tokens must be comma-separated ints, got {args.tokens!r}")
    if args.tokens and min(args.tokens) < 1:
        parser.error("--tokens must be >= 1")
    return args


def _ops_model(eps: float):
    from infini_dist.ops import all_reduce_add_rms_norm, all_reduce_swiglu

    def run(x, residual, weight):
        out, _ = all_reduce_add_rms_norm(x, residual, weight, eps=eps)
        return all_reduce_swiglu(x, out)
    return run


def _decoder(args, device, dtype):
    import infini_dist.compile as idc
    from infini_dist.launch.tp_decoder import Decoder, ModelConfig, check_shapes
    cfg = ModelConfig(args.layers, args.hidden, args.mlp, args.heads, args.kv_heads, 1,
                      args.eps)
    check_shapes(cfg, dist.get_world_size())
    model = Decoder(cfg, dist.group.WORLD, device, dtype)
    return idc.compile_model(model, backend=args.backend, dynamic=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = init_job()
    shared = torch.Generator(device=device).manual_seed(0)  # the same inputs on every rank
    if args.model == "ops":
        model = _ops_model(args.eps)
        weight = 1 + 0.1 * torch.randn(args.hidden, generator=shared, device=device).to(dtype)

        def make_inputs(tokens):
            x, residual = (torch.randn(tokens, args.hidden, generator=shared,
                                       device=device).to(dtype) for _ in "xr")
            return x * (dist.get_rank() + 1), residual, weight
    else:
        model = _decoder(args, device, dtype)

        def make_inputs(tokens):
            return torch.randn(1, tokens, args.hidden, generator=shared, device=device).to(dtype)
    summary = infini_dist.warmup(model, make_inputs, token_counts=args.tokens)
    if dist.get_rank() == 0:
        print(f"infini-dist tune: {len(summary['token_counts'])} token counts, "
              f"{summary['tuned']} site(s) tuned, {summary['cached']} from the cache, "
              f"{summary['seconds']:.1f}s; decisions in {infini_dist.config.cache_dir}",
              flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
