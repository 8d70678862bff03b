"""`infini-dist bench --train` at a tiny size on 2 gloo CPU ranks: both variants train, the loss
curves agree, and the pass rewrote forward (all_reduce -> add+RMSNorm, rsqrt exposed) and
backward (input-gradient all_reduces with their epilogues) sites."""

from __future__ import annotations

import json

import pytest

from infini_dist.launch import bench_train
from multirank import run_cli, run_ranks

TINY = ["--device", "cpu", "--tokens", "16", "--steps", "3", "--warmup", "1", "--layers", "1",
        "--hidden", "32", "--mlp", "64", "--heads", "4", "--kv-heads", "2"]


def test_train_bench_runs_small_on_cpu(tmp_path):
    """Every variant in one job, the matmul prologue's too: config.matmul_prologue is off for
    the job (its CPU "auto" is off as well, compile/passes.py), so that variant turning it on
    beside the pass without it is the flag's A/B in one run. Its forward sites take their
    row-parallel projection (the backward needs the matmul's inputs, never its output), the
    other variants' do not, and every loss curve is plain compile's. (A job of its own for the
    prologue compiled inductor and infini_dist a second time.)"""
    out = tmp_path / "out"
    # fused AdamW (the foreach default is the same code with the other flag)
    variants = list(bench_train.VARIANTS)
    run = run_cli(tmp_path, "bench", "--train", "--nproc", "2", *TINY, "--out", str(out),
                  "--variants", ",".join(variants), "--optimizers", "fused", timeout=500,
                  INFINI_DIST_MATMUL_PROLOGUE="0")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["dtype"] == "float32"
    assert data["meta"]["matmul_prologue"] is False
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == set(variants)
    for row in rows.values():
        assert len(row["losses"]) == 3 and row["step_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["optimizer"] == "fused"
        # the pass's variants compiled until their sites decided, before the first step
        assert row["compiles_while_timed"] == 0, row
    # compile_model compiled again where a decision changed what the pass writes: at most a
    # whole site decided bare -> its all_reduce alone, decided native -> Inductor's code
    # (later variants reuse decisions)
    assert {r["variant"]: r["recompiles"] for r in rows.values()
            if r["recompiles"] is not None and not 0 <= r["recompiles"] <= 2} == {}, rows
    assert rows["inductor"]["sites"] == 0 and rows["inductor_overlap"]["native_sites"] == 0
    # The floor: every collective of its forward and backward graphs gone (2 + 2 a layer), and
    # its sums partial, so its curve is its own (the pass's equals inductor's, below).
    floor = rows[bench_train.FLOOR]
    assert floor["collectives_removed"] == 4 and floor["collectives_left"] == 0, floor
    assert floor["sites"] == 0 and floor["losses"] != rows["inductor"]["losses"]
    # Forward: the site after attention and after the MLP; backward: the two input gradients.
    # Compiled after they decided: each replaced, or left to Inductor where decided native.
    assert rows["infini_dist"]["sites"] + rows["infini_dist"]["native_sites"] == 4
    assert rows["inductor"]["native_sites"] == 0
    for variant in ("infini_dist", "infini_dist_overlap", "infini_dist_eager_timing"):
        ops = rows[variant]["site_ops"]
        assert "all_reduce+add_rms_norm+rms_rstd" in ops
        assert any(o.startswith("all_reduce+") and "rms" not in o for o in ops)  # backward's
    # the prologue's variant: its forward sites start with the GEMM, its backward's do not;
    # no other variant's site takes a matmul
    ops = rows[bench_train.MATMUL]["site_ops"]
    assert "matmul+all_reduce+add_rms_norm+rms_rstd" in ops, ops
    assert any(o.startswith("all_reduce+") for o in ops), ops  # the backward's, no matmul
    assert not any(o.startswith("matmul") for v in variants if v != bench_train.MATMUL
                   for o in rows[v]["site_ops"]), rows
    # with the "overlap" fusion type the backward sites take their layer's weight gradient:
    # gate_up's (the norm backward's two muls after it) and qkv's (one mul)
    wgrad = rows[bench_train.WGRAD]["site_ops"]
    assert {"weight_gradient+all_reduce+mul+mul", "weight_gradient+all_reduce+mul"} <= set(
        wgrad), wgrad
    verdicts = {v["variant"]: v for v in data["verdicts"]}
    assert set(verdicts) == {"inductor_overlap", "infini_dist", "infini_dist_overlap",
                             "infini_dist_forward_overlap", "infini_dist_eager_timing",
                             bench_train.WGRAD, bench_train.MATMUL, bench_train.FLOOR}
    # config.backward_sites off: the two forward sites only, the backward left to Inductor
    forward_only = rows["infini_dist_forward_overlap"]
    assert forward_only["sites"] + forward_only["native_sites"] == 2, forward_only
    # (a forward site decided to fuse nothing is made again as its all_reduce alone; the
    # backward's epilogues are the norm backward's muls)
    assert not any("mul" in o for o in forward_only["site_ops"]), forward_only
    assert verdicts["infini_dist_forward_overlap"]["loss_rel_diff"] < 1e-4
    assert verdicts["inductor_overlap"]["loss_ok"] and rows["inductor_overlap"]["sites"] == 0
    for variant in ("infini_dist", "infini_dist_overlap", "infini_dist_eager_timing",
                    bench_train.WGRAD, bench_train.MATMUL):
        verdict = verdicts[variant]
        assert verdict["tokens"] == 16 and verdict["loss_ok"] and verdict["loss_rel_diff"] < 1e-4
        assert verdict["over_floor"] == pytest.approx(
            rows[variant]["step_ms"] / floor["step_ms"])
        best_plain = min(rows["inductor"]["step_ms"], rows["inductor_overlap"]["step_ms"])
        assert verdict["speedup_over_best_plain"] == pytest.approx(
            best_plain / rows[variant]["step_ms"])
    assert verdicts[bench_train.FLOOR]["loss_ok"] and verdicts[bench_train.FLOOR][
        "loss_rel_diff"] is None
    assert (out / "table.md").read_text().startswith("| tokens/step |")


def _overlapped_all_reduces(rank, world_size, options):
    """How many all_reduces of the compiled decoder (forward and backward) have compute between
    their start and their wait, and how many there are."""
    import re

    import torch
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from infini_dist.launch.tp_decoder import ModelConfig
    torch.manual_seed(0)
    model = bench_train.TrainDecoder(ModelConfig(1, 32, 64, 4, 2, context=16), dist.group.WORLD,
                                     torch.device("cpu"), torch.float32)
    compiled = torch.compile(model, options=options)
    _, codes = run_and_get_code(lambda: compiled(torch.randn(1, 16, 32)).sum().backward())
    overlapped = total = 0
    for code in codes:
        lines = code.splitlines()
        for index, line in enumerate(lines):
            start = re.search(r"all_reduce_\.default\((?:reinterpret_tensor\()?(buf\d+)", line)
            if not start:
                continue
            total += 1
            between = []
            for later in lines[index + 1:]:
                if "wait_tensor.default" in later and start.group(1) in later:
                    break
                between.append(later)
            overlapped += any("extern_kernels.mm" in x or "cpp_fused" in x for x in between)
    return overlapped, total


def test_the_overlap_peer_runs_compute_between_an_all_reduce_and_its_wait(tmp_path):
    # inductor_overlap is the user's own overlap (Inductor moving the NCCL wait after the
    # weight-gradient GEMMs); plain compile waits at once
    plain, overlap = (run_ranks(_overlapped_all_reduces, 2, options, timeout=240)[0]
                      for options in ({}, bench_train.OVERLAP))
    assert plain[1] == overlap[1] == 4, (plain, overlap)  # 2 forward, 2 backward (one layer)
    assert plain[0] == 0 and overlap[0] >= 1, (plain, overlap)


def test_train_bench_arguments():
    args = bench_train.parse_args(["--tokens", "64,128", "--steps", "4", "--warmup", "2"])
    assert args.tokens == [64, 128] and args.model.context == 128 and not args.cpu_smoke
    assert args.variants == ["inductor", "inductor_overlap", "infini_dist", "infini_dist_overlap",
                             "infini_dist_forward_overlap", "collective_free"]  # wgrad: asked for
    assert args.optimizers == ["foreach"]
    assert bench_train.parse_args(["--optimizers", "fused,foreach"]).optimizers == [
        "fused", "foreach"]
    assert bench_train.parse_args(["--variants", "infini_dist_eager_timing"]).variants == [
        "inductor", "infini_dist_eager_timing"]
    for bad in (["--tokens", "a"], ["--tokens", "0"], ["--steps", "2", "--warmup", "2"],
                ["--variants", "infini_dist,fast"], ["--optimizers", "sgd"]):
        with pytest.raises(SystemExit):
            bench_train.parse_args(bad)


def test_one_rank_symm_offers_the_symm_kernels_at_one_rank(monkeypatch):
    import torch

    from infini_dist.scheduler.backends import symm
    from infini_dist.scheduler.choices import RunContext
    from symm_cases import build, full_span, meta_of
    monkeypatch.setattr(symm, "plan_span", symm.plan_span)  # restored after the test
    graph = build("add_rms_norm")
    span, meta = full_span(graph), meta_of(graph, (4, 64), torch.bfloat16)
    one = RunContext(None, 1, 0, torch.device("cuda"))
    assert symm.plan_span(span, meta, one) is None  # the engine's rule: two ranks or more
    bench_train.parse_args(TINY + ["--one-rank-symm"])
    plan = symm.plan_span(span, meta, one)
    assert plan is not None and plan == symm.plan_span(
        span, meta, RunContext(None, 2, 0, torch.device("cuda")))


def test_profile_train_runs_its_variants_on_cpu(tmp_path):
    """launch/profile_train.py (a trace of the step per variant) on 2 gloo ranks: it shares
    bench_train's step, so a change there must not leave it behind."""
    import sys

    from multirank import launch_env, run_process
    out = tmp_path / "prof"
    run = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "-m", "infini_dist.launch.profile_train", *TINY,
                       "--variants", f"inductor,{bench_train.WGRAD}", "--prof-steps", "1",
                       "--out", str(out)], env=launch_env(tmp_path), timeout=400,
                      cwd=str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "profile.json").read_text())
    assert set(results) == {"inductor", bench_train.WGRAD}
    assert all(r["step_ms"] > 0 for r in results.values())
    # the variant's sites, the backward's with their weight gradients
    assert any(s["op"].startswith("weight_gradient+all_reduce")
               for s in results[bench_train.WGRAD]["sites"])


def test_profile_train_charges_idle_gaps_to_the_late_launch():
    """profile_train.idle_gaps on a made-up trace: a gap is charged to the host ranges open
    when the kernel ending it was launched, on that launch's thread; overlapping kernels on two
    streams leave no gap; gaps under the threshold are not counted."""
    from infini_dist.launch.profile_train import idle_gaps

    def ev(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0,
                "tid": tid, "args": args}
    trace = {"traceEvents": [
        ev("user_annotation", "Optimizer.step", 0, 1000),
        ev("cpu_op", "aten::_foreach_add_", 10, 50),
        ev("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=1),
        ev("cpu_op", "aten::mm", 200, 100, tid=2),  # another thread: not open at launch 2
        ev("cpu_op", "infini_dist::site", 150, 300),
        ev("cuda_driver", "cuLaunchKernelEx", 400, 5, correlation=2),
        ev("cuda_runtime", "cudaLaunchKernel", 30, 5, correlation=3),
        ev("kernel", "a", 100, 50, correlation=1),             # busy 100..150
        ev("kernel", "b", 140, 20, correlation=3),             # overlaps a: no gap
        ev("kernel", "c", 162, 10, correlation=3),             # 2 us gap: under the threshold
        ev("kernel", "d", 410, 10, correlation=2),             # 238 us gap, launched late
    ]}
    found = idle_gaps(trace, steps=2)
    assert found["idle_us"] == 238 / 2
    assert found["gaps"] == [("Optimizer.step", "infini_dist::site", 119.0, 0.5)]


def test_profile_train_splits_marked_steps_into_phases():
    """profile_train.device_phases: each marked step's forward + backward runs to the
    optimizer's first kernel, the optimizer from there to the step's last kernel."""
    from infini_dist.launch.profile_train import MARK, device_phases

    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    step = [kernel("gemm", 10, 30), kernel("lamport", 45, 5),
            kernel("multi_tensor_apply_kernel", 60, 20), kernel("FillFunc", 85, 5)]
    trace = {"traceEvents": [kernel(MARK, 0, 1), *step, kernel(MARK, 200, 1),
                             *({**k, "ts": k["ts"] + 200} for k in step)]}
    assert device_phases(trace) == [(50, 30), (50, 30)]
    assert device_phases({"traceEvents": step}) == []  # no marks: no steps to split


def test_the_table_reads_the_head_start_steps_against_the_floors():
    """bench_train.table with --head-start-ms rows: the device's step (the step behind a sleep,
    less the sleep), over the floor's of the same tokens and AdamW, and the host stalls (the
    step less the device's)."""
    def row(variant, step, ahead):
        return dict(tokens=2048, optimizer="foreach", variant=variant, step_ms=step,
                    tokens_per_s=1.0, sites=0, native_sites=0, losses=[1.0],
                    head_start_step_ms=ahead, cpp_launches_per_step=16.0,
                    host_ms={"forward": 2.5, "backward": 3.0, "optimizer": 2.0})
    text = bench_train.table([row("infini_dist", 18.0, 17.2), row(bench_train.FLOOR, 17.0, 16.0)],
                             [])
    lines = text.splitlines()
    assert "| 2048 | foreach | infini_dist | 18.00 | 17.20 | 1.075 | 0.80 | 2.50 / 3.00 / " \
           "2.00 | 16.0 |" in lines
    assert f"| 2048 | foreach | {bench_train.FLOOR} | 17.00 | 16.00 | 1.000 | 1.00 |" in \
        " ".join(lines)
