"""`infini-dist`: start the demo, a benchmark or a warm-up under torchrun, one rank per GPU (or 2
on CPU); `infini-dist cache ...` manages the decision cache and `infini-dist build` builds the
eager ops' C++ module ahead of time (no torchrun)."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

from infini_dist.launch import build_express
from infini_dist.launch.arguments import positive_int

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # never multicast: it can take a shared host's GPUs down

# subcommand -> the module under launch/ that torchrun starts, and its help
RUNS = {"demo": ("demo", "run the tensor-parallel demo block"),
        "bench": ("bench", "run the collective + epilogue latency sweep"),
        "tune": ("tune", "warm up every token bucket of a model before serving")}
# `bench FLAG` starts another module, with that module's flags instead of the sweep's
BENCH_MODES = {"--model": ("bench_model", "the end-to-end TP decoder benchmark"),
               "--hf": ("bench_hf", "Hugging Face models under transformers' TP: llama, "
                                    "qwen2, mistral"),
               "--train": ("bench_train", "the TP decoder training step benchmark"),
               "--sp": ("bench_sp", "sequence parallelism (torch's TP-tutorial plan): forward "
                                    "and training step"),
               "--eager": ("bench_eager", "eager op calls against a bare NCCL all_reduce: host "
                                          "and device time, and the path that served them")}


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


def _add_run_arguments(parser, module_name: str) -> None:
    """The module's own flags, as every rank parses them, and the rank count."""
    module = importlib.import_module(f"infini_dist.launch.{module_name}")
    module.add_arguments(parser)
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="ranks to start (default: one per GPU, or 2 on CPU)")
    parser.set_defaults(module=module, parser=parser)


def bench_mode_parser(flag: str) -> argparse.ArgumentParser:
    module_name, help_text = BENCH_MODES[flag]
    # allow_abbrev off here and below: the words go on to the ranks as written, and --nproc
    # (this process's flag) must be found by its full name to be taken out of them
    parser = argparse.ArgumentParser(prog=f"infini-dist bench {flag}", description=help_text,
                                     allow_abbrev=False)
    if flag != "--hf":  # --hf is bench_hf's own flag, the families
        parser.add_argument(flag, action="store_true", dest="bench_mode", help="this benchmark")
    _add_run_arguments(parser, module_name)
    return parser


def _bench_epilog() -> str:
    lines = ["other benchmarks, each with its own flags instead of the sweep's:"]
    for flag, (_, help_text) in BENCH_MODES.items():
        usage = bench_mode_parser(flag).format_usage().replace("usage: ", "", 1)
        lines += [f"  {flag}: {help_text}", "    " + usage.strip().replace("\n", "\n  ")]
    return "\n".join(lines)


def build_parser():
    """The CLI's parser, and its subcommands' parsers by name."""
    from infini_dist.launch import cache_cli
    parser = argparse.ArgumentParser(prog="infini-dist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    runs = {}
    for name, (module_name, help_text) in RUNS.items():
        extra = {}
        if name == "bench":  # the epilog's lines as written: one usage line per benchmark
            extra = dict(epilog=_bench_epilog(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        runs[name] = sub.add_parser(name, help=help_text, description=help_text,
                                    allow_abbrev=False, **extra)
        _add_run_arguments(runs[name], module_name)
    cache = sub.add_parser("cache", help="list | show KEY | clear [KEY ...] decisions",
                           description=cache_cli.__doc__.split("\n")[0])
    cache_cli.add_arguments(cache)
    sub.add_parser("build", help="build the eager ops' C++ module now (else: in the background, "
                                 "at the first eager call)",
                   description=build_express.__doc__.split("\n")[0])
    return parser, runs


def _bench_mode(bench: argparse.ArgumentParser, words: list[str]) -> str | None:
    chosen = {word.split("=", 1)[0] for word in words} & set(BENCH_MODES)
    if len(chosen) > 1:
        *others, last = BENCH_MODES
        bench.error(f"one of {', '.join(others)} and {last}")
    return chosen.pop() if chosen else None


def _forwarded(words: list[str], own: dict[str, int]) -> list[str]:
    """`words` less the flags in `own` (flag: how many values follow it), which only this
    process reads: the ranks' parsers do not know them."""
    kept, skip = [], 0
    for word in words:
        if skip:
            skip -= 1
        elif word.split("=", 1)[0] in own:
            skip = 0 if "=" in word else own[word]
        else:
            kept.append(word)
    return kept


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, runs = build_parser()
    words = argv[1:]
    mode = _bench_mode(runs["bench"], words) if argv[:1] == ["bench"] else None
    if mode:
        args = bench_mode_parser(mode).parse_args(words)
    else:
        args = parser.parse_args(argv)
        if args.command == "cache":
            from infini_dist.launch import cache_cli
            return cache_cli.run(args)
        if args.command == "build":
            return build_express.main()
    nproc = args.nproc or default_nproc()
    # the rules between flags, for this many ranks: a refusal here starts no rank
    args.module.finish(args.parser, args, nproc)
    own = {"--nproc": 1, **({mode: 0} if mode in ("--model", "--train", "--sp", "--eager") else {})}
    return torchrun(args.module.__name__, nproc, _forwarded(words, own))


if __name__ == "__main__":
    sys.exit(main())
