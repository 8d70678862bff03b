"""`infini-dist` checks every argument before it starts a rank: a bad one is argparse's one
message and exit status 2, with no torchrun; every subcommand's --help lists its flags. All in
this process, with torchrun replaced by a stand-in that records what it would have started."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from infini_dist.launch import cli


@pytest.fixture
def started(monkeypatch):
    """The torchrun jobs main() asked for: (module, nproc, words the ranks get)."""
    jobs = []
    monkeypatch.setattr(cli, "torchrun", lambda *job: jobs.append(job) or 0)
    monkeypatch.setattr(cli, "default_nproc", lambda: 2)
    return jobs


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    return err.splitlines()[-1]


BAD = [  # (argv, what the one message says)
    (["tune", "--tokens", "abc"], "argument --tokens: must be comma-separated positive integers"),
    (["tune", "--tokens", "1,0"], "argument --tokens: must be comma-separated positive integers"),
    (["tune", "--model", "nonsense"], "argument --model: invalid choice: 'nonsense'"),
    (["tune", "--hidden", "-5"], "argument --hidden: must be a positive integer, got '-5'"),
    (["tune", "--layers", "0"], "argument --layers: must be a positive integer"),
    (["tune", "--eps", "nan"], "argument --eps: must be a positive number"),
    (["tune", "--hf", "gpt2"], "argument --hf: neither a family (llama, qwen2, mistral, mixtral)"),
    (["tune", "--hf", "llama", "--model", "ops"], "--hf takes the place of --model"),
    (["tune", "--heads", "6", "--kv-heads", "4"], "--heads 6 is not a multiple of --kv-heads 4"),
    (["tune", "--nproc", "3"], "--kv-heads 8 is not divisible by the tensor-parallel size 3"),
    (["tune", "--nproc", "0"], "argument --nproc: must be a positive integer"),
    (["tune", "--nosuch"], "unrecognized arguments: --nosuch"),
    (["tune", "--nproc"], "argument --nproc: expected one argument"),
    (["demo", "--tokens", "x"], "argument --tokens: must be a positive integer"),
    (["demo", "--hidden", "2"], "--hidden 2 must be at least 2 heads x 2 ranks"),
    (["demo", "--layers", "-1"], "argument --layers: must be a positive integer"),
    (["bench", "--tokens", ""], "argument --tokens: must be comma-separated positive integers"),
    (["bench", "--patterns", "add_rms_norm,nope"], "argument --patterns: choose among"),
    (["bench", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["bench", "--trials", "0"], "argument --trials: must be a positive integer"),
    (["bench", "--noise", "-1"], "argument --noise: must be a number >= 0"),
    (["bench", "--model", "--train"], "one of --model, --hf, --train, --sp and --eager"),
    (["bench", "--eager", "--first-minute", "-1"], "argument --first-minute: must be a number"),
    (["bench", "--eager", "--tokens", "0"], "argument --tokens: must be comma-separated"),
    (["bench", "--eager", "--one-rank-symm", "--first-minute", "5"],
     "--one-rank-symm forces the choices"),
    (["bench", "--model", "--batches", "1,a"], "argument --batches: must be comma-separated"),
    (["bench", "--model", "--prefill", "-1"], "argument --prefill: must be an integer >= 0"),
    (["bench", "--model", "--variants", "fast"], "argument --variants: choose among"),
    (["bench", "--model", "--patterns", "swiglu"], "unrecognized arguments: --patterns"),
    (["bench", "--model", "--heads", "6", "--kv-heads", "2", "--nproc", "4"],
     "--heads 6 is not divisible by the tensor-parallel size 4"),
    (["bench", "--hf", "gpt2"], "argument --hf: choose among llama,qwen2,mistral"),
    (["bench", "--hf", "llama", "--round-calls", "0"], "argument --round-calls: must be a posit"),
    (["bench", "--hf", "llama", "--batches", "", "--prefill", ""], "no shape"),
    (["bench", "--train", "--tokens", "a"], "argument --tokens: must be comma-separated"),
    (["bench", "--train", "--steps", "2", "--warmup", "2"], "--steps must be greater than"),
    (["bench", "--train", "--lr", "0"], "argument --lr: must be a positive number"),
    (["cache", "frobnicate"], "argument action: invalid choice: 'frobnicate'"),
    (["cache", "show"], "the following arguments are required: key"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_one_message_and_no_rank(argv, message, started, capsys):
    assert message in refused(argv, capsys)
    assert started == []


HELP = {  # subcommand words -> flags its --help must list
    ("demo",): ["--tokens", "--hidden", "--layers", "--compile", "--nproc"],
    ("tune",): ["--model", "--tokens", "--layers", "--hidden", "--mlp", "--heads", "--kv-heads",
                "--eps", "--hf", "--vocab", "--backend", "--nproc"],
    ("bench",): ["--tokens", "--hidden", "--patterns", "--dtype", "--out", "--trials",
                 "--replays", "--no-eager", "--no-compile-peer", "--no-flashinfer",
                 "--no-native-inductor", "--noise", "--cpu-smoke", "--nproc",
                 # and the other benchmarks' own flags
                 "--model", "--hf", "--train", "--sp", "--context", "--batches", "--prefill", "--iters",
                 "--variants", "--tol", "--matmul-prologue", "--rounds", "--round-calls",
                 "--profile", "--mode", "--vocab", "--device", "--steps", "--warmup", "--lr",
                 "--one-rank-symm"],
    ("bench", "--model"): ["--layers", "--hidden", "--mlp", "--heads", "--kv-heads", "--context",
                           "--batches", "--prefill", "--iters", "--variants", "--tol",
                           "--matmul-prologue", "--out", "--cpu-smoke", "--nproc"],
    ("bench", "--hf", "llama"): ["--hf", "--layers", "--vocab", "--context", "--batches",
                                 "--prefill", "--iters", "--rounds", "--round-calls",
                                 "--profile", "--variants", "--mode", "--tol",
                                 "--matmul-prologue", "--nproc"],
    ("bench", "--train"): ["--out", "--device", "--tokens", "--variants", "--steps", "--warmup",
                           "--lr", "--tol", "--one-rank-symm", "--layers", "--kv-heads",
                           "--nproc"],
    ("bench", "--sp"): ["--tokens", "--layers", "--hidden", "--mlp", "--head-dim", "--variants",
                        "--kinds", "--force", "--eager-timing", "--rounds", "--iters", "--steps", "--warmup", "--lr", "--tol",
                        "--out", "--cpu-smoke", "--nproc"],
    ("bench", "--eager"): ["--tokens", "--hidden", "--first-minute", "--layers",
                           "--one-rank-symm", "--nproc"],
    ("cache",): ["--cache-dir", "list", "show", "clear"],
    ("cache", "list"): ["--cache-dir"],
    ("build",): ["--help"],
}


@pytest.mark.parametrize("words", list(HELP), ids=" ".join)
def test_help_lists_every_flag(words, started, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*words, "--help"])
    assert exit_.value.code == 0 and started == []
    out = capsys.readouterr().out
    missing = [flag for flag in HELP[words] if flag not in out]
    assert not missing, out


@pytest.mark.parametrize("argv, module, nproc, words", [
    (["tune", "--nproc", "4", "--model", "ops", "--tokens", "1,8"], "infini_dist.launch.tune", 4,
     ["--model", "ops", "--tokens", "1,8"]),
    (["demo", "--compile", "--nproc=1"], "infini_dist.launch.demo", 1, ["--compile"]),
    (["bench", "--cpu-smoke", "--tokens", "2"], "infini_dist.launch.bench", 2,
     ["--cpu-smoke", "--tokens", "2"]),
    (["bench", "--model", "--nproc", "2", "--layers", "1"], "infini_dist.launch.bench_model", 2,
     ["--layers", "1"]),
    (["bench", "--hf", "llama", "--hidden", "64"], "infini_dist.launch.bench_hf", 2,
     ["--hf", "llama", "--hidden", "64"]),
    (["bench", "--train", "--device", "cpu"], "infini_dist.launch.bench_train", 2,
     ["--device", "cpu"]),
    (["bench", "--sp", "--nproc", "2", "--force", "symm_scatter_gather"],
     "infini_dist.launch.bench_sp", 2, ["--force", "symm_scatter_gather"]),
    (["bench", "--eager", "--nproc", "2", "--first-minute", "60"],
     "infini_dist.launch.bench_eager", 2, ["--first-minute", "60"]),
])
def test_good_arguments_reach_the_ranks_as_written(argv, module, nproc, words, started):
    """--nproc and bench's --model / --train / --eager are this process's: the ranks get the
    rest."""
    assert cli.main(argv) == 0
    assert started == [(module, nproc, words)]


@pytest.mark.parametrize("order", ["before", "after"])
def test_cache_dir_before_or_after_the_action(order, tmp_path, started, capsys):
    record = {"op": "all_reduce+add", "bucket": 8, "dtypes": ["float32"], "choice": "native",
              "times_s": {"native": 1e-5}, "world_size": 2, "device": "cpu", "versions": {}}
    (tmp_path / "abcdef0123456789.json").write_text(json.dumps(record))
    where = ["--cache-dir", str(tmp_path)]
    argv = ["cache", *where, "list"] if order == "before" else ["cache", "list", *where]
    assert cli.main(argv) == 0 and started == []
    out = capsys.readouterr().out
    assert "abcdef012345" in out and f"1 decision(s) in {tmp_path}" in out


def test_build_makes_the_cpp_module_without_a_rank(started, capsys, monkeypatch):
    """`infini-dist build`: the eager ops' C++ module now, in this process (here the CPU
    variant; a compile on a fresh machine, else the cached build); a failure is exit status 1
    and one line saying why."""
    from infini_dist.kernels import express
    calls = []
    built = SimpleNamespace(__name__="infini_dist_express", __file__="/cache/express.so")
    monkeypatch.setattr(express, "build", lambda: calls.append(1) or built)
    assert cli.main(["build"]) == 0 and calls == [1] and started == []
    assert "infini_dist_express ready in" in capsys.readouterr().out

    def broken():
        raise TimeoutError("another process held the build lock")
    monkeypatch.setattr(express, "build", broken)
    assert cli.main(["build"]) == 1 and started == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TimeoutError: another process held the build lock" in err[0]
