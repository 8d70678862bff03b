"""`infini-dist bench --sp` (launch/bench_sp.py) at a tiny size on 2 gloo CPU ranks: every variant
runs forward and training steps, the pass makes its sequence-parallel sites, and the checks that
fail the run (an output off eager, a loss curve off inductor's) do fail it."""

from __future__ import annotations

import json

from infini_dist.launch import bench_sp, sp_report
from multirank import run_cli


def test_sp_bench_runs_small_on_cpu(tmp_path):
    out = tmp_path / "out"
    # the floor's compile is bench_model's and bench_hf's too (their CPU smokes run it); here
    # its ratios are checked through compare() below
    run = run_cli(tmp_path, "bench", "--sp", "--nproc", "2", "--cpu-smoke", "--rounds", "2",
                  "--steps", "2", "--warmup", "1", "--iters", "2", "--profile",
                  "--variants", "inductor,infini_dist", "--out", str(out), timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["failures"] == [] and data["meta"]["world_size"] == 2
    rows = {(r["variant"], r["kind"]): r for r in data["rows"]}
    variants = ("inductor", "infini_dist")
    assert set(rows) == {(v, k) for v in variants for k in ("forward", "train")}
    assert all(r["ms"] > 0 and r["spread"] >= 1.0 for r in rows.values())
    # the untimed rounds absorbed every recompile (a decided site's drops the code its class
    # shares with the other variants): no timed round includes a compile
    assert all(r["compiles_while_timed"] == 0 for r in rows.values()), rows
    assert all(rows[v, "forward"]["host_ms"] > 0 for v in variants)
    for kind in ("forward", "train"):
        assert rows["infini_dist", kind]["sites"] > 0
        assert rows["infini_dist", kind]["over_inductor"] > 0
    assert "-- profile 16 forward infini_dist, by host time --" in run.stdout
    assert rows["infini_dist", "forward"]["rel_l2_vs_eager"] < 1e-4
    assert rows["infini_dist", "train"]["loss_rel_diff"] < 1e-4
    # the warm-up step, 1 to 3 untimed rounds (until one compiles nothing) and two timed rounds,
    # of 2 steps each: every step's loss
    assert len(rows["infini_dist", "train"]["losses"]) in [1 + 2 * k + 2 * 2 for k in (1, 2, 3)]


def _row(variant, kind, ms, **more):
    return {"variant": variant, "kind": kind, "tokens": 16, "ms": ms, **more}


def test_compare_fails_a_wrong_output_a_loss_curve_and_an_error():
    rows = [_row("inductor", "forward", 2.0, rel_l2_vs_eager=1e-6),
            _row("infini_dist", "forward", 1.0, rel_l2_vs_eager=0.3),
            _row("inductor", "train", 4.0, losses=[1.0, 0.5]),
            _row("infini_dist", "train", 3.0, losses=[1.0, 0.9]),
            _row("collective_free", "train", 2.0, losses=[7.0, 7.0])]
    failures = sp_report.compare(rows, tol=1e-2)
    assert len(failures) == 2 and "rel L2" in failures[0] and "loss curve" in failures[1]
    assert rows[1]["over_inductor"] == 0.5 and rows[3]["over_floor"] == 1.5
    assert rows[2]["over_floor"] == 2.0  # inductor's own ratio to the floor
    broken = [_row("inductor", "forward", 2.0), {"variant": "infini_dist", "kind": "forward",
                                                  "tokens": 16, "error": "forward: rank 1: boom"}]
    assert sp_report.compare(broken, tol=1e-2) == ["16 forward infini_dist: forward: rank 1: boom"]


def test_prefer_ranks_the_forced_algorithm_deepest_first():
    hook = bench_sp.prefer("one_shot_scatter_gather")
    times = hook({"native": 1.0, "symm_scatter_gather[p0,e3]": 1.0,
                  "one_shot_scatter_gather[p0,e1]": 9.0, "one_shot_scatter_gather[p0,e3]": 9.0})
    assert min(times, key=times.get) == "one_shot_scatter_gather[p0,e3]"
    assert max(times, key=times.get) == "native"


def test_a_forced_process_neither_loads_nor_leaves_decisions(monkeypatch):
    import infini_dist
    from infini_dist.scheduler.store import STORE
    monkeypatch.setattr(STORE, "timing_hook", None)
    with infini_dist.config.patch(enable_disk_cache=True):
        bench_sp.force("one_shot_scatter_gather")
        assert infini_dist.config.snapshot().enable_disk_cache is False
        times = STORE.timing_hook({"native": 1.0, "one_shot_scatter_gather[p0,e2]": 9.0})
        assert min(times, key=times.get) == "one_shot_scatter_gather[p0,e2]"
