"""`infini-dist bench --hf`: Hugging Face models under transformers' own TP (DTensor, gloo).

One run on 2 CPU ranks with a one-layer Llama (random weights saved and loaded with
tp_plan="auto"): a decode step over a StaticCache and a prefill, the infini_dist pass and the
collective-free step (the floor: every collective a no-op) against eager. The plain compiled
variant is left out there (it is the same code path with another torch.compile call) to keep
Inductor's compiles, the slow part, to four. The rest runs in process.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading needs it

from infini_dist.launch import bench_hf  # noqa: E402
from infini_dist.launch.tp_decoder import Shape  # noqa: E402
from multirank import run_cli  # noqa: E402

TINY = ["--layers", "1", "--hidden", "64", "--mlp", "128", "--heads", "4", "--kv-heads", "2",
        "--vocab", "256", "--context", "8", "--batches", "2", "--prefill", "16", "--iters", "2",
        "--rounds", "2", "--round-calls", "3"]


def test_cpu_smoke_llama_tp(tmp_path):
    out = tmp_path / "out"
    run = run_cli(tmp_path, "bench", "--hf", "llama", "--nproc", "2", "--cpu-smoke", *TINY,
                  "--variants", "infini_dist,collective_free,eager", "--profile", "--out", str(out),
                  timeout=400,
                  HF_HUB_OFFLINE="1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    data = json.loads((out / "results.json").read_text())
    meta = data["meta"]
    assert meta["world_size"] == 2 and meta["families"] == ["llama"] and meta["mode"] == "default"
    assert meta["config"]["hidden"] == 64
    rows = {(r["family"], r["shape"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {("llama", s, v) for s in ("decode b2", "prefill 16")
                         for v in ("infini_dist", "collective_free", "eager")}
    for (_, shape, variant), row in rows.items():
        assert "error" not in row, row
        assert row["median_us"] > 0 and math.isfinite(row["median_us"])
        assert row["mode"] == "calls", row  # the bench's own capture is off under --hf
        if variant == "eager":
            continue
        assert row["cudagraphs"] is False, row  # mode="default": none asked for, none skipped
        assert "cudagraph_skips" not in row, row
        # interleaved rounds (2 x 3 calls) under no_grad as the first call: no recompile
        assert row["samples"] == 6 and row["timing_graphs"] == 0, row
        assert row["dynamo_graphs"] == 1
        if variant == "collective_free":
            # embedding, o_proj and down_proj all_reduces, the lm_head's all_gather: all gone
            assert row["floor"] and row["collectives_removed"] == 4, row
            assert row["collectives_left"] == 0 and "rel_l2_vs_eager" not in row, row
            continue
        floor = rows[("llama", shape, "collective_free")]["median_us"]
        assert row["over_floor"] == pytest.approx(row["median_us"] / floor)
        # fp32: only reordering separates the compiled TP model from eager DTensor
        assert math.isfinite(row["rel_l2_vs_eager"]) and row["rel_l2_vs_eager"] < 1e-4
        assert row["call_p10_us"] <= row["median_us"] == row["call_us"] <= row["call_p90_us"]
        assert row["host_us"] > 0 and row["round_spread"] >= 1 and "gpu_us" not in row
        if row["kind"] == "decode":  # --profile: one decode step's host view
            view = row["profile"]
            assert view["host_us_per_step"] > 0 and view["top_host_ops"], view
            assert view["graph_launches_per_step"] == 0  # no CUDA graph on CPU
        # embedding all_reduce -> input RMSNorm, o_proj -> add + RMSNorm, down_proj -> add +
        # final norm: DTensor's all_reduces in transformers' Llama plan, all rewritten
        assert row["sites"] == 3 and row["pass_graphs"] == 1, row
        assert len(row["decisions"]) == 3
        for d in row["decisions"]:
            assert d["choice"] in d["times_us"] and "native" in d["times_us"]
    assert data["verdict"]["check_failures"] == []
    # no model directory left behind under --out; rank 0's profiler trace of the decode step
    assert sorted(p.name for p in out.iterdir()) == [
        "results.json", "trace_llama_decode_b2_collective_free.json",
        "trace_llama_decode_b2_infini_dist.json"]

    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert lines[-1] == "correctness: infini_dist vs eager, relative L2 <= 0.0001: ok"
    assert lines[-2].startswith("target: infini_dist <= 1.03x the collective_free step at decode "
                                "batch <= 32, never slower than inductor: ")
    assert lines[-3].startswith("floor: collective_free") and \
        lines[-3].endswith("8 collective(s) replaced, none left")
    for line, shape in zip(lines[-5:-3], ("decode b2", "prefill 16")):
        b, f = rows[("llama", shape, "infini_dist")], rows[("llama", shape, "collective_free")]
        cells = line.split()
        assert line.strip().startswith(shape) and f"{b['median_us']:.1f}" in cells
        # floor, b/f beside the pass's time; a/f is '-' without the plain variant
        assert f"{f['median_us']:.1f}" in cells and f"{b['over_floor']:.3f}" in cells
    assert lines[-6].split()[:5] == ["shape", "inductor", "+infini", "floor", "eager"]
    assert "== llama ==" in run.stdout and "interleaved timing" in run.stdout
    assert "profile decode b2 infini_dist (rank 0, per step): host" in run.stdout


def test_configs_of_every_family():
    assert bench_hf.parse_args(TINY).families == ["llama", "qwen2", "mistral"]  # dense ones
    args = bench_hf.parse_args(TINY + ["--hf", "llama,qwen2,mistral,mixtral"])
    assert args.families == ["llama", "qwen2", "mistral", "mixtral"]
    assert args.mode == "reduce-overhead"
    assert [s.name for s in args.shapes] == ["decode b2", "prefill 16"]
    for family in args.families:
        cfg = bench_hf.make_config(family, args)
        assert cfg.model_type == family
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                cfg.num_key_value_heads, cfg.num_hidden_layers, cfg.vocab_size) == \
            (64, 128, 4, 2, 1, 256)
        assert cfg.max_position_embeddings >= 16 and not cfg.tie_word_embeddings
        assert getattr(cfg, "sliding_window", None) is None or family == "qwen2" \
            and not cfg.use_sliding_window
    mixtral = bench_hf.make_config("mixtral", args)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)


def test_tp_plan_argument_follows_transformers(monkeypatch):
    import transformers
    kwargs = bench_hf.tp_load_kwargs()
    if "distributed_config" in kwargs:  # 5.18 and later
        assert kwargs["distributed_config"].tp_plan == "auto"

    class Older:  # a DistributedConfig without the plan, as before 5.18
        def __init__(self, enable_expert_parallel: bool = False):
            pass
    for stand_in in (Older, None):
        monkeypatch.setattr(transformers, "DistributedConfig", stand_in)
        assert bench_hf.tp_load_kwargs() == {"tp_plan": "auto"}  # 5.17, the GPU image


def test_floor_target_and_checks():
    """Decode is judged against the collective-free step (plain's ratio beside it), prefill
    against plain; a floor that kept a collective fails the run."""
    class Args:
        tol, variants = 1e-2, ["inductor", "infini_dist", "collective_free", "eager"]
    d1, d8, pre = Shape("decode", 1, 1), Shape("decode", 8, 1), Shape("prefill", 1, 1024)
    floor = dict(collectives_removed=4, collectives_left=0, floor=True)
    rows = [dict(shape=d1.name, variant="inductor", median_us=110.0, rel_l2_vs_eager=1e-3),
            dict(shape=d1.name, variant="infini_dist", median_us=102.0, rel_l2_vs_eager=1e-3),
            dict(shape=d1.name, variant="collective_free", median_us=100.0, **floor),
            dict(shape=d8.name, variant="inductor", median_us=130.0, rel_l2_vs_eager=1e-3),
            dict(shape=d8.name, variant="infini_dist", median_us=125.0, rel_l2_vs_eager=1e-3),
            dict(shape=d8.name, variant="collective_free", median_us=120.0,
                 **{**floor, "collectives_left": 1}),
            dict(shape=pre.name, variant="inductor", median_us=900.0, rel_l2_vs_eager=1e-3),
            dict(shape=pre.name, variant="infini_dist", median_us=950.0, rel_l2_vs_eager=1e-3),
            dict(shape=pre.name, variant="collective_free", median_us=800.0, **floor)]
    # the steps as the device alone made them (step_timing.time_device): decode b1, and
    # prefill without plain's (its calls waited for the device), so prefill is not judged
    for variant, us in (("inductor", 104.0), ("infini_dist", 101.0), ("collective_free", 97.0)):
        rows[[r["variant"] for r in rows[:3]].index(variant)]["device_us"] = us
    rows[-2]["device_us"], rows[-1]["device_us"] = 940.0, 790.0
    bench_hf.add_floor_ratios(rows)
    by = {(r["shape"], r["variant"]): r for r in rows}
    assert by[(d1.name, "infini_dist")]["over_floor_device"] == pytest.approx(101 / 97)
    assert "over_floor_device" not in by[(d8.name, "infini_dist")]
    assert by[(d1.name, "infini_dist")]["over_floor"] == pytest.approx(1.02)
    assert by[(d1.name, "inductor")]["over_floor"] == pytest.approx(1.1)
    assert "over_floor" not in by[(d1.name, "collective_free")]
    lines, verdict = bench_hf.summary(rows, [d1, d8, pre], Args, False, bench_hf.TARGET)
    # b1: 1.02x <= 1.03x, met; b8: 1.042x; prefill: slower than plain
    assert verdict["target_misses"] == [
        "decode b8: 1.042x the collective_free step > 1.03x (inductor 1.083x)",
        "prefill 1024: 0.95x < 1.0x"]
    assert verdict["check_failures"] == [
        "decode b8: collective_free is no floor: 4 collective(s) replaced, 1 left in its graphs"]
    # b1 on the device: 101 / 97 = 1.041 > 1.03
    assert verdict["device_target_misses"] == [
        "decode b1: 1.041x the collective_free step > 1.03x (inductor 1.072x)"]
    assert lines[-1].endswith(": ok")  # the pass's logits are fine; the floor is the failure
    assert lines[-3] == "device-only step (host kept ahead; b/f): decode b1 1.041 (inductor " \
        "1.072; 101.0 us); prefill 1024 1.190 (inductor -; 940.0 us)"
    assert lines[-2] == "target on the device-only step: NOT met: decode b1: 1.041x the " \
        "collective_free step > 1.03x (inductor 1.072x); not judged (a variant's calls waited " \
        "for the device): prefill 1024"
    assert lines[-5].startswith("floor: ") and "1 left in its graphs" in lines[-5]
    assert "1.020  1.100" in lines[3]  # decode b1: b/f, a/f
    # only unjudged shapes: neither met nor missed
    prefill_rows = [r for r in rows if r["shape"] == pre.name]
    lines, verdict = bench_hf.summary(prefill_rows, [pre], Args, False, bench_hf.TARGET)
    assert verdict["device_target_misses"] == []
    assert lines[-2] == "target on the device-only step: not judged (a variant's calls " \
        "waited for the device): prefill 1024"


@pytest.mark.parametrize("argv, message", [
    (["--hf", "gpt2"], "--hf: choose among llama,qwen2,mistral,mixtral"),
    (["--variants", "nope"], "--variants: choose among"),
    (["--batches", "", "--prefill", ""], "no shape"),
    (["--heads", "6", "--kv-heads", "4"], "must be a multiple of --kv-heads 4"),
    (["--round-calls", "0"], "argument --round-calls: must be a positive integer"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_hf.parse_args(argv)
    assert message in capsys.readouterr().err
