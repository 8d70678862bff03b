"""argparse types and the parse step the torchrun modules share.

Each module under torchrun (demo, tune, bench, bench_model, bench_hf, bench_train) defines its
flags once, in `add_arguments(parser)`, with these types, and its rules between flags in
`finish(parser, args, world)`. `infini-dist` runs both on its own subcommand parser before it
starts any rank, so a bad argument is one argparse message and exit status 2, not one traceback
per rank; every rank runs them again through `parse` on the same words, and agrees.
"""

from __future__ import annotations

import argparse
import os


def _number(kind, text: str, ok, what: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):  # NaN fails every comparison: refused too
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v > 0, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: 0 < v < float("inf"), "a positive number")


def nonnegative_float(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def positive_ints(text: str) -> list[int]:
    """Comma-separated positive integers; '' is the empty list (a flag's "none")."""
    try:
        return [positive_int(t) for t in text.split(",") if t.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated positive integers, got {text!r}") from None


def nonempty_ints(text: str) -> list[int]:
    values = positive_ints(text)
    if not values:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated positive integers, got {text!r}")
    return values


def names(choices):
    """A type for a comma-separated, non-empty list of `choices`, in the order given."""
    def parse(text: str) -> list[str]:
        chosen = [t.strip() for t in text.split(",") if t.strip()]
        if not chosen or set(chosen) - set(choices):
            raise argparse.ArgumentTypeError(f"choose among {','.join(choices)}, got {text!r}")
        return chosen
    parse.__name__ = "names"
    return parse


def add_model_sizes(parser, layers: int, **more: int) -> None:
    """--layers, and the decoder's widths at Llama-3-8B's by default; `more`: flag -> default."""
    sizes = {"layers": layers, "hidden": 4096, "mlp": 14336, "heads": 32, "kv-heads": 8, **more}
    for flag, default in sizes.items():
        parser.add_argument(f"--{flag}", type=positive_int, default=default)


def add_matmul_prologue(parser) -> None:
    """--[no-]matmul-prologue: the model benchmarks' switch for config.matmul_prologue (None:
    the config's value)."""
    parser.add_argument("--matmul-prologue", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="the pass also takes each row-parallel matmul into its site, or "
                             "not (config.matmul_prologue; default: the config's value, 'auto', "
                             "on where Inductor captures CUDA graphs; also "
                             "INFINI_DIST_MATMUL_PROLOGUE=1/0/auto): GEMM + all_reduce overlap")


def add_decode_shapes(parser, batches: str) -> None:
    """The decode steps a model benchmark times: one per batch size, over --context positions."""
    parser.add_argument("--context", type=positive_int, default=1024,
                        help="positions in the static KV cache before the decode step")
    parser.add_argument("--batches", type=positive_ints, default=batches,
                        help="decode batch sizes ('' for none)")


def usage_error(parser, check, *args) -> None:
    """Run `check(*args)`; its ValueError is the parser's error (one message, exit status 2)."""
    try:
        check(*args)
    except ValueError as error:
        parser.error(str(error))


def world_size() -> int:
    """The ranks of this torchrun job: a rank checks its sizes before it joins any group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse(argv, add_arguments, finish, **parser_kwargs) -> argparse.Namespace:
    """A module's own parse under torchrun: its flags, then its rules between flags."""
    parser = argparse.ArgumentParser(**parser_kwargs)
    add_arguments(parser)
    args = parser.parse_args(argv)
    finish(parser, args, world_size())
    return args
