"""`infini-dist`: start the demo, a benchmark or a warm-up under torchrun, one rank per GPU (or 2
on CPU); `infini-dist cache ...` manages the decision cache (no torchrun)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # never multicast: it can take a shared host's GPUs down


def default_nproc() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def torchrun(module: str, nproc: int, args: list[str]) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", module, *args]
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(command, env=env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="infini-dist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [("demo", "run the tensor-parallel demo block"),
                            ("bench", "run the collective + epilogue benchmark sweep"),
                            ("tune", "warm up every token bucket of a model (launch/tune.py)")]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--nproc", type=int, default=None,
                       help="ranks to start (default: one per GPU, or 2 on CPU)")
        if name == "bench":
            p.add_argument("--model", action="store_true",
                           help="the end-to-end TP decoder benchmark (launch/bench_model.py)")
            p.add_argument("--hf", metavar="FAMILY[,FAMILY]",
                           help="Hugging Face models under transformers' TP: llama, qwen2, "
                                "mistral (launch/bench_hf.py)")
            p.add_argument("--train", action="store_true",
                           help="the TP decoder training step benchmark (launch/bench_train.py)")
    # Its own parser reads the rest, -h included.
    sub.add_parser("cache", help="list | show KEY | clear [KEY ...] decisions", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "cache":
        from infini_dist.launch import cache_cli
        return cache_cli.main(rest)
    nproc = args.nproc or default_nproc()
    if nproc < 1:
        parser.error("--nproc must be >= 1")
    module = {"demo": "infini_dist.launch.demo", "bench": "infini_dist.launch.bench",
              "tune": "infini_dist.launch.tune"}[args.command]
    if sum(map(bool, (getattr(args, "model", False), getattr(args, "hf", None),
                      getattr(args, "train", False)))) > 1:
        parser.error("bench: one of --model, --hf and --train")
    if getattr(args, "model", False):
        module = "infini_dist.launch.bench_model"
    if getattr(args, "hf", None):
        module, rest = "infini_dist.launch.bench_hf", ["--hf", args.hf, *rest]
    if getattr(args, "train", False):
        module = "infini_dist.launch.bench_train"
    return torchrun(module, nproc, rest)


if __name__ == "__main__":
    sys.exit(main())
