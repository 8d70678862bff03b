"""HF generate() with the pass in the ways users write it (`launch/bench_generate.py`).

On 2 gloo ranks, fp32, a 2-layer Llama with random weights (no download): the driver runs one
round of every route, each a fresh torchrun job, and every route's greedy tokens must equal
plain compile's and eager's exactly; the pass must have made its sites in the two routes that
carry it and in no other. generate() compiles only on accelerators, so on CPU the compiled routes
set CompileConfig's `_compile_all_devices` (transformers' switch for testing), and the test
checks that each of them really compiled (Dynamo graphs > 0) and eager did not.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading needs it

from infini_dist.launch import bench_generate as bg  # noqa: E402
from infini_dist.launch import generate_report as gr  # noqa: E402
from multirank import launch_env, run_process  # noqa: E402

TINY = ["--layers", "2", "--hidden", "64", "--mlp", "128", "--heads", "4", "--kv-heads", "2",
        "--vocab", "256", "--prompt", "8", "--new-tokens", "8", "--warmup", "1", "--reps", "2"]


def drive(tmp_path, *argv, timeout, **env):
    out = tmp_path / "out"
    try:
        run = run_process([sys.executable, "-m", "infini_dist.launch.bench_generate",
                           "--out", str(out), *argv], timeout=timeout,
                          env=launch_env(tmp_path, HF_HUB_OFFLINE="1", **env))
    except subprocess.TimeoutExpired as error:  # say which job and phase the time went to
        output = [text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                  for text in (error.stdout, error.stderr)]
        pytest.fail(f"bench_generate passed its {timeout} s limit; its stdout ends\n"
                    f"{output[0][-3000:]}\nand its stderr\n{output[1][-3000:]}")
    results = {p.stem.split("_", 1)[1]: json.loads(p.read_text())
               for p in sorted(out.glob("round0_*.json"))}
    return run, results, out


@pytest.mark.timeout(500)
def test_every_route_makes_plain_compiles_tokens_on_cpu(tmp_path):
    run, results, out = drive(tmp_path, "--alternate", "1", "--nproc", "2", "--cpu-smoke",
                              "--variants", "plain,enable,compile_config,eager", *TINY,
                              "--profile", str(tmp_path / "profile"), timeout=460)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert sorted(results) == sorted(bg.VARIANTS)
    plain = results["plain"]["tokens"]
    assert len(plain) == 1 and len(plain[0]) == 8 and len(set(plain[0])) > 1, plain
    for variant, r in results.items():
        assert r["tokens"] == plain == results["eager"]["tokens"], variant  # fp32: exact
        assert r["dtype"] == "float32" and r["world_size"] == 2 and r["ranks_agree"], r
        assert r["timing_graphs"] == 0, r  # no compile inside the timed generate calls
        assert r["cudagraphs"] is False  # CPU
        assert 0 < r["step_ms"] < r["wall_ms"] and r["tokens_per_s"] > 0
        assert len(r["step_ms_p10_p90"]) == 2
        if variant == "eager":
            assert r["dynamo_graphs"] == 0 and r["sites"] == 0, r
        elif variant == "plain":  # compiled (forced on CPU), no pass
            assert r["dynamo_graphs"] == 1 and r["pass_graphs"] == 0 and r["sites"] == 0, r
        else:
            # one graph through the pass: the embedding's all_reduce -> input RMSNorm, and per
            # layer o_proj -> add + RMSNorm, down_proj -> add + the next (or final) norm
            assert r["pass_ran"] and r["pass_graphs"] == 1, r
            assert r["sites"] == r["last_sites"] == 5, r
            assert {op for op, _ in r["decisions"]} == {"all_reduce+rms_norm",
                                                        "all_reduce+add_rms_norm"}, r
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp32"] and summary["problems"] == [] and summary["rounds"] == 1
    rows = {r["variant"]: r for r in summary["rows"]}
    assert rows["enable"]["sites"] == 5 and rows["plain"]["compiled"]
    assert all(r["first_divergence"] is None and r["compared"] == 1 for r in rows.values())
    # --profile: one more call per route and rank, its host time by op: the pass routes' sites
    # run as our op, plain's collectives as c10d's
    for variant in bg.VARIANTS:
        for rank in (0, 1):
            text = (tmp_path / "profile" / f"{variant}_rank{rank}.txt").read_text()
            assert text.startswith(f"{variant}, rank {rank}: one generate call of 8 tokens")
            assert ("infini_dist::fused_site" in text) == (variant in gr.WITH_PASS), text
    lines = run.stdout.splitlines()
    assert lines[-1] == "verdict: ok" and lines[-2].startswith("speed: enable "), lines[-2:]
    enable = next(line for line in lines if line.startswith("| enable | 1 | "))
    assert enable.endswith("| yes | 5 | no | same |"), enable


def test_first_divergence_and_the_verdict():
    assert gr.first_divergence([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) is None
    assert gr.first_divergence([[1, 2, 3], [4, 9, 6]], [[1, 2, 7], [4, 5, 6]]) == 1
    assert gr.first_divergence([[1, 2]], [[1, 2, 3]]) == 2  # cut short
    base = dict(tokens_per_s=100.0, step_ms=10.0, e2e_tokens_per_s=90.0, sites=0,
                pass_ran=False, dynamo_graphs=1, timing_graphs=0, cudagraphs=True,
                ranks_agree=True, dtype="bfloat16")
    runs = {"plain": [dict(base, tokens=[[5, 6, 7, 8]], exit_status=0),
                      dict(base, tokens_per_s=80.0, tokens=[[5, 6, 7, 8]], exit_status=1)],
            "enable": [dict(base, sites=9, pass_ran=True, tokens=[[5, 6, 9, 9]]),
                       {"error": "exit status 1"}],
            "compile_config": [dict(base, tokens=[[5, 6, 7, 8]], timing_graphs=2)]}
    rows = {r["variant"]: r for r in gr.summarize(runs)}
    assert rows["plain"]["tokens_per_s"] == 90.0 and (rows["plain"]["min"],
                                                      rows["plain"]["max"]) == (80.0, 100.0)
    assert rows["enable"]["first_divergence"] == 2 and rows["enable"]["failed"] == 1
    bf16 = gr.verdict(list(rows.values()), fp32=False)  # divergence is reported, not wrong
    assert bf16 == ["enable: 1 run(s) failed",
                    "plain: 1 job(s) wrote results, then exited non-zero",
                    "compile_config: the pass made no site",
                    "compile_config: compiled again during the timed calls"]
    assert "enable: tokens differ from plain's at step 2" in \
        gr.verdict(list(rows.values()), fp32=True)
    line = next(x for x in gr.table(list(rows.values()), 4) if x.startswith("| enable"))
    assert "2 (1 failed)" in line and "first differs at step 2 of 4" in line


def test_speed_is_judged_against_the_spread_of_processes():
    def rows(plain, enable):
        base = dict(step_ms=10.0, e2e_tokens_per_s=90.0, sites=8, pass_ran=True,
                    dynamo_graphs=1, timing_graphs=0, cudagraphs=True, ranks_agree=True,
                    tokens=[[5, 6]])
        runs = {"plain": [dict(base, tokens_per_s=t, sites=0, pass_ran=False) for t in plain],
                "enable": [dict(base, tokens_per_s=t) for t in enable]}
        return gr.summarize(runs)

    apart = rows([500.0, 540.0, 520.0], [400.0, 410.0, 420.0])  # slower in every process
    assert gr.verdict(apart, fp32=False) == [
        "enable: slower than plain in every process (420.0 tokens/s at best, plain 500.0 at "
        "worst)"]
    assert gr.speed(apart) == "enable 0.79x plain's median, slower in every process"
    assert gr.verdict(apart, fp32=True) == []  # the CPU smoke's host costs are not judged
    assert gr.verdict(rows([500.0], [400.0]), fp32=False) == []  # one process: no spread
    overlapping = rows([445.0, 535.0, 553.0], [391.0, 403.0, 446.0])  # session 15's 2xH100 run
    assert gr.verdict(overlapping, fp32=False) == []
    assert gr.speed(overlapping) == ("enable 0.75x plain's median, within the spread of the "
                                     "processes")
    faster = rows([400.0, 410.0], [500.0, 510.0])
    assert gr.verdict(faster, fp32=False) == [] and "faster in every process" in gr.speed(faster)


@pytest.mark.parametrize("cpu", [True, False])
def test_each_route_compiles_as_users_write_it(cpu):
    from transformers import GenerationConfig

    import infini_dist.compile as idc
    model = types.SimpleNamespace(generation_config=GenerationConfig(eos_token_id=2))
    configs = {v: bg.generation_config(model, v, cpu, 16) for v in bg.VARIANTS}
    for c in configs.values():
        assert (c.do_sample, c.max_new_tokens, c.eos_token_id, c.cache_implementation) == \
            (False, 16, None, "static")
    assert configs["eager"].disable_compile and configs["eager"].compile_config is None
    route = configs["compile_config"].compile_config
    assert route.mode is None  # torch.compile refuses a mode together with options
    ours = "post_grad_custom_post_pass"
    assert route.options[ours] == idc.inductor_options()[ours] is not None
    assert route.options.get("triton.cudagraphs") is (None if cpu else True)
    # generate() deep-copies its config and compiles again when the copy differs: it must not
    assert copy.deepcopy(configs["compile_config"]).compile_config == route
    for variant in ("plain", "enable"):
        compile_config = configs[variant].compile_config
        if cpu:  # forced: HF compiles on accelerators only
            assert compile_config.mode == "default" and compile_config._compile_all_devices
        else:  # HF's own default, mode="reduce-overhead"
            assert compile_config is None and not configs[variant].disable_compile
    assert route._compile_all_devices is (True if cpu else None)


@pytest.mark.parametrize("argv, message", [
    ([], "give one of --variant"),
    (["--variant", "plain", "--alternate", "2"], "give one of --variant"),
    (["--variant", "nope"], "invalid choice"),
    (["--alternate", "1", "--variants", "plain,x"], "--variants: choose among"),
    (["--alternate", "1", "--nproc", "3"], "divisible by 3 ranks"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bg.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.multigpu
@pytest.mark.timeout(520)
def test_routes_replay_cuda_graphs_with_the_pass_on_gpus(tmp_path):
    # Three fresh jobs, each compiling from nothing (the first pass route also every kernel its
    # tuning tries): on 2xH200 the 280 s this had before passed inside the second job. Inductor
    # compiles in parallel here, as it does for users (launch_env's one thread is for CPU CI).
    # A cross-rank exchange that waits 150 s fails with its error (the default, 300 s, would
    # outlast the test), so a stuck job shows where it stuck.
    run, results, _ = drive(tmp_path, "--alternate", "1", "--nproc", "2", "--layers", "2",
                            "--hidden", "1024", "--mlp", "2048", "--heads", "8", "--kv-heads", "4",
                            "--vocab", "4096", "--prompt", "16", "--new-tokens", "16",
                            timeout=500, INFINI_DIST_TUNING_TIMEOUT_S="150",
                            TORCHINDUCTOR_COMPILE_THREADS=str(min(16, os.cpu_count() or 1)))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert sorted(results) == ["compile_config", "enable", "plain"]
    for variant, r in results.items():
        assert r["dtype"] == "bfloat16" and r["ranks_agree"] and r["timing_graphs"] == 0, r
        assert r["cudagraphs"], r  # HF's reduce-overhead compile replayed its graphs
        # 2 per layer (o_proj, down_proj); the embedding's too where the TP plan shards it
        assert r["pass_ran"] == (variant != "plain") and (r["sites"] >= 4) == r["pass_ran"], r
