"""`infini-dist tune`: warm up every token bucket of a model before serving (under torchrun).

    infini-dist tune --model tp_decoder --tokens 1,8,32,1024 --layers 4 --hidden 4096 ...
    infini-dist tune --model ops --tokens 1,8,32 --hidden 4096
    infini-dist tune --hf llama --tokens 1,8,32,1024 --layers 4 --hidden 4096 ...
    infini-dist tune --hf path/to/config.json --tokens 1,8,32       (or a model directory)

`tp_decoder` is the benchmark's Llama-style TP decoder (launch/tp_decoder.py, random weights)
compiled with the infini_dist pass, dynamic in the token count; each count runs a prefill of that
many tokens, which reaches the same sites as decode at that batch size. `ops` runs the eager fused
ops (all_reduce + add + RMSNorm, all_reduce + SwiGLU) at (tokens, hidden). Decisions go to the
configured cache dir (`INFINI_DIST_CACHE_DIR`), where later jobs load them.

`--hf` builds a Hugging Face model as `bench --hf` does (launch/bench_hf.py): a family's config
from the size flags, or the config of a path, with random weights (nothing is downloaded), loaded
under transformers' own TP, compiled with the pass, dynamic in the token count; each count runs
a prefill of that many tokens without a cache. The site shapes, hence the decisions, depend on
the config only, not on the weights: a served checkpoint of that config finds them.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import infini_dist
from infini_dist.launch import init_job, shutdown
from infini_dist.launch.arguments import (add_model_sizes, parse, positive_float, positive_int,
                                          positive_ints, usage_error)


def hf_model(text: str) -> str:
    """--hf: a family bench_hf builds, or a config.json or model directory on this machine."""
    from infini_dist.launch.bench_hf import FAMILIES
    if text not in FAMILIES and not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"neither a family ({', '.join(FAMILIES)}) nor a path: "
                                         f"{text!r}")
    return text


def add_arguments(parser):
    parser.add_argument("--model", choices=("tp_decoder", "ops"), default="tp_decoder")
    parser.add_argument("--tokens", type=positive_ints, default="",
                        help="token counts, comma-separated (default: one per bucket)")
    add_model_sizes(parser, layers=1)
    parser.add_argument("--eps", type=positive_float, default=1e-6)
    parser.add_argument("--hf", metavar="FAMILY|CONFIG", type=hf_model,
                        help="a Hugging Face model: llama, qwen2 or mistral (sized by the flags "
                             "above and --vocab), or a config.json or model directory")
    parser.add_argument("--vocab", type=positive_int, default=32000,
                        help="--hf FAMILY's vocabulary")
    parser.add_argument("--backend", choices=("inductor", "infini_dist"), default="inductor",
                        help="tp_decoder's torch.compile backend")


def finish(parser, args, world):
    from infini_dist.launch.bench_hf import FAMILIES
    from infini_dist.launch.tp_decoder import ModelConfig, check_shapes
    args.tokens = args.tokens or None  # warmup's default: one count per bucket
    if args.hf and (args.backend != "inductor" or args.model != "tp_decoder"):
        parser.error("--hf takes the place of --model and compiles with Inductor")
    args.config = ModelConfig(args.layers, args.hidden, args.mlp, args.heads, args.kv_heads, 1,
                              args.eps)
    # the flags size tp_decoder and an --hf family; a config read from a path has its own sizes
    if args.model == "tp_decoder" and (not args.hf or args.hf in FAMILIES):
        usage_error(parser, check_shapes, args.config, world)


def parse_args(argv=None):
    return parse(argv, add_arguments, finish, prog="infini-dist tune",
                 description=__doc__.split("\n")[0])


def hf_config(args):
    """The config --hf names: a family sized by the flags, or one read from a path."""
    from infini_dist.launch import bench_hf
    from infini_dist.scheduler import buckets
    if args.hf in bench_hf.FAMILIES:
        longest = max(args.tokens or buckets.bounds(infini_dist.config.snapshot()))
        sizes = argparse.Namespace(hidden=args.hidden, mlp=args.mlp, heads=args.heads,
                                   kv_heads=args.kv_heads, layers=args.layers, vocab=args.vocab,
                                   context=longest, prefill=[])
        return bench_hf.make_config(args.hf, sizes)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(args.hf, local_files_only=True)


def _hf_model(args, device, dtype):
    import tempfile

    import infini_dist.compile as idc
    from infini_dist.launch.bench_hf import load_tp_model
    control = dist.new_group(backend="gloo")
    # rank 0 saves the random weights in a fresh directory there, the others load them from it
    model = load_tp_model(hf_config(args), tempfile.gettempdir(), device, dtype, control)
    return idc.compile_model(model, dynamic=True)


def _ops_model(eps: float):
    from infini_dist.ops import all_reduce_add_rms_norm, all_reduce_swiglu

    def run(x, residual, weight):
        out, _ = all_reduce_add_rms_norm(x, residual, weight, eps=eps)
        return all_reduce_swiglu(x, out)
    return run


def _decoder(args, device, dtype):
    import infini_dist.compile as idc
    from infini_dist.launch.tp_decoder import Decoder
    model = Decoder(args.config, dist.group.WORLD, device, dtype)  # sizes checked by finish
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
    elif args.hf:
        model = _hf_model(args, device, dtype)
        vocab = model.config.vocab_size

        def make_inputs(tokens):
            ids = torch.randint(0, vocab, (1, tokens), generator=shared, device=device)
            return {"input_ids": ids, "use_cache": False}
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
