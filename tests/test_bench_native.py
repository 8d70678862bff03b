"""`infini-dist bench` (the collective + epilogue sweep): the native row and the engine-vs-native
check. The GPU sweep cannot run here; --cpu-smoke runs the whole script on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import json

from infini_dist.launch import bench_patterns, bench_targets, peers_flashinfer
from multirank import run_cli


def _row(impl, graph, eager, pattern="swiglu", tokens=16):
    return {"pattern": pattern, "tokens": tokens, "impl": impl, "graph_us": graph,
            "eager_us": eager}


def test_above_native_lists_only_engine_rows_slower_than_native_beyond_noise():
    rows = [_row("native", 10.0, 40.0), _row("engine", 10.4, 45.0),  # graph within 5%, eager not
            _row("cand:x[p0,e1]", 99.0, 99.0),  # candidates are not the engine row
            _row("native", 20.0, None, tokens=128), _row("engine", 19.0, None, tokens=128),
            _row("engine", 50.0, 50.0, pattern="relu_scale")]  # no native row to compare with
    found = bench_targets.above_native(rows, 0.05)
    assert found == [{"pattern": "swiglu", "tokens": 16, "mode": "eager", "engine_us": 45.0,
                      "native_us": 40.0}]
    assert bench_targets.above_native(rows, 0.2) == []


def test_cpu_smoke_has_native_and_engine_rows(tmp_path):
    out = tmp_path / "out"
    # rows of another process of the same run (the NCCL-symmetric peer's), merged into the tables
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"meta": {"graph_calls": 10},  # as the peer's process writes
                                 "rows": [_row("nccl_symm_ar", None, 3.0, "add_rms_norm", 2)]}))
    run = run_cli(tmp_path, "bench", "--nproc", "2", "--cpu-smoke", "--tokens", "2", "--hidden",
                  "32", "--patterns",
                  "add_rms_norm,add_rms_norm_fp8,add_rms_norm_fp8_tensor,add_rms_norm_fp8_token",
                  "--trials", "2", "--replays", "2", "--extra-rows", str(extra),
                  "--out", str(out), timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"native", "cand:native", "engine"} <= impls
    assert data["meta"]["graph_calls"] == 10  # the engine's tuning captures as many a graph
    assert not any("unfused" in name for name in impls)
    case = data["meta"]["cases"]["add_rms_norm/2"]
    assert case["engine_vs_native_max_abs"] < 1e-5  # float32 on CPU
    assert "native" in case["tuning_times_us"]
    # The FP8 row, in the input's units: at most one e4m3 step (8 at scaled values below 64)
    fp8 = data["meta"]["cases"]["add_rms_norm_fp8/2"]
    assert fp8["engine_vs_native_max_abs"] <= bench_patterns.FP8_SCALE * 8
    assert {("add_rms_norm_fp8", "engine"), ("add_rms_norm_fp8", "native")} <= {
        (r["pattern"], r["impl"]) for r in data["rows"]}
    # the scale a checkpoint's one-element tensor: the same bound, and a choice of the whole
    # site (the quantizer at epilogue depth 2) timed
    held = data["meta"]["cases"]["add_rms_norm_fp8_tensor/2"]
    assert held["engine_vs_native_max_abs"] <= bench_patterns.FP8_SCALE * 8
    assert any(name.endswith(",e2]") for name in held["tuning_times_us"]), held
    # per-token scales: dequantized, one step is at most 2^-3 of a normed value of a few units
    token = data["meta"]["cases"]["add_rms_norm_fp8_token/2"]
    assert token["engine_vs_native_max_abs"] <= 0.5, token
    assert "add_rms_norm_fp8_token/2 " in run.stdout.split("FP8 epilogue cost")[1]
    assert isinstance(data["meta"]["engine_above_native"], list)
    assert "engine above native by more than 5%" in run.stdout
    # FlashInfer is an optional peer: absent (or on CPU ranks) it is named once, then skipped.
    skip = (peers_flashinfer.NOT_INSTALLED if importlib.util.find_spec("flashinfer") is None
            else "flashinfer: needs CUDA ranks; its rows are skipped")
    assert run.stdout.count(skip) == 1
    assert not any(name.startswith("fi_") for name in impls)
    assert "add_rms_norm (graph, us, max over ranks)" in run.stdout  # the table still comes
    eager_table = run.stdout.split("add_rms_norm (eager, us, max over ranks)")[1]
    assert "nccl_symm_ar" in eager_table.split("\n\n")[0]
    assert "nccl_symm_ar" in impls  # and results.json has it
    assert "engine / the fastest all-reduce alone (eager): add_rms_norm/2 " in run.stdout


def test_targets_read_the_fastest_peer_of_each_case():
    rows = [_row("nccl_ar", 20.0, 40.0, "add_rms_norm", 1), _row("symm_two_shot_ar", 8.0, 10.0,
                                                                 "add_rms_norm", 1),
            _row("native", 30.0, 60.0, "add_rms_norm", 1), _row("engine", 6.0, 9.0,
                                                                "add_rms_norm", 1),
            _row("nccl_symm_ar", 30.0, 30.0, "add_rms_norm", 8192),
            _row("engine", 33.0, 33.0, "add_rms_norm", 8192),
            _row("fi_fused_one_shot", 9.0, 12.0, "add_rms_norm", 1),
            _row("fi_fused_two_shot", 7.5, 30.0, "add_rms_norm", 1)]
    # against the fastest all-reduce alone (8 us), not the native or FlashInfer rows
    assert bench_targets.engine_vs_ar_alone(rows) == ["add_rms_norm/1 0.75",
                                                      "add_rms_norm/8192 1.10"]
    assert bench_targets.engine_vs_ar_alone(rows, "eager") == ["add_rms_norm/1 0.90",
                                                               "add_rms_norm/8192 1.10"]
    # the fastest FlashInfer row (7.5 us) over ours (6 us); no FlashInfer row at 8192
    assert bench_targets.engine_vs_flashinfer(rows) == ["add_rms_norm/1 1.25x"]
    assert bench_targets.fp8_cost(rows + [_row("engine", 6.3, 9.0, "add_rms_norm_fp8", 1)],
                                  "graph") == ["add_rms_norm_fp8/1 1.050"]


def test_extra_rows_keep_only_the_sweeps_cases(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": [_row("nccl_symm_ar", 7.0, 25.0, "add_rms_norm", 1),
                                         _row("nccl_symm_ar", 7.0, 25.0, "add_rms_norm", 64),
                                         _row("nccl_symm", 9.0, 50.0, "relu_scale", 1)]}))
    assert bench_targets.extra_rows([str(path)], ["add_rms_norm"], [1, 16]) == [
        _row("nccl_symm_ar", 7.0, 25.0, "add_rms_norm", 1)]


def test_extra_rows_of_another_graph_method_are_left_out(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {"graph_calls": 10},
                                "rows": [_row("nccl_symm_ar", 7.0, 25.0, "add_rms_norm", 1)]}))
    assert bench_targets.extra_rows([str(path)], ["add_rms_norm"], [1], graph_calls=10) == [
        _row("nccl_symm_ar", 7.0, 25.0, "add_rms_norm", 1)]
    assert bench_targets.extra_rows([str(path)], ["add_rms_norm"], [1], graph_calls=1) == []
    assert "timed with 10 call(s) a CUDA graph, this sweep with 1" in capsys.readouterr().out


def test_a_graph_holds_graph_calls_calls_and_its_replay_is_divided(monkeypatch):
    """Timer.graph, its CUDA calls faked: the eager and side-stream warm-up calls, then
    graph_calls calls captured, and the replay's time per call."""
    import contextlib
    import types

    from infini_dist.launch import bench
    captured = []

    class FakeGraph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def capture(graph):
        captured.append("begin")
        yield
        captured.append("end")

    fake_stream = types.SimpleNamespace(wait_stream=lambda other: None)
    for name, value in {"synchronize": lambda device=None: None, "Stream": lambda d: fake_stream,
                        "stream": lambda s: contextlib.nullcontext(),
                        "current_stream": lambda d=None: fake_stream,
                        "CUDAGraph": FakeGraph, "graph": capture}.items():
        monkeypatch.setattr(bench.torch.cuda, name, value)
    monkeypatch.setattr(bench.dist, "barrier", lambda: None)
    timer = bench.Timer(types.SimpleNamespace(type="cuda"), trials=1, replays=1, graph_calls=4)
    monkeypatch.setattr(timer, "_measure", lambda body, reset: 8e-6)  # one replay: 8 us
    calls = []
    assert timer.graph(lambda: calls.append(list(captured))) == 2e-6
    # two warm-up calls outside any capture, then four inside one
    assert [len(c) for c in calls] == [0, 0, 1, 1, 1, 1] and captured == ["begin", "end"]
