"""`infini-dist bench --model`: the end-to-end TP decoder benchmark.

One run of the whole flow on 2 gloo CPU ranks (--cpu-smoke, tiny sizes): the compiled variants
(plain, the pass, the collective-free floor) and eager, decode and prefill, the table,
results.json and the correctness check. The rest runs in process: the decode attention against
a plain reference, the size checks and the verdict.
Inductor's C++ compiles are the slow part (about half a minute on 2 idle cores), so there is one
run with one decode batch size and one prefill.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from infini_dist.launch import bench_model, tp_decoder
from infini_dist.launch.tp_decoder import ModelConfig, Shape
from multirank import run_cli

TINY = ["--layers", "2", "--hidden", "32", "--mlp", "64", "--heads", "4", "--kv-heads", "2",
        "--context", "8", "--batches", "2", "--prefill", "4", "--iters", "2"]


def test_cpu_smoke_runs_the_whole_flow(tmp_path):
    out = tmp_path / "out"
    run = run_cli(tmp_path, "bench", "--model", "--nproc", "2", "--cpu-smoke", *TINY,
                  "--out", str(out), timeout=400)  # 6 compiles: 80 s idle, 210 s on a busy box
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["cpu_smoke"]
    rows = {(r["shape"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(s, v) for s in ("decode b2", "prefill 4")
                         for v in ("inductor", "infini_dist", "collective_free", "eager")}
    for (shape, variant), row in rows.items():
        assert "error" not in row and row["mode"] == "eager", row
        assert row["median_us"] > 0
        if variant == "collective_free":  # the o_proj and down_proj all_reduces of 2 layers
            assert row["collectives_removed"] == 4 and row["collectives_left"] == 0, row
            assert "rel_l2_vs_eager" not in row and "over_floor" not in row
        elif variant != "eager":
            assert row["dynamo_graphs"] == 1  # compiled once for this shape, no graph break
            assert row["rel_l2_vs_eager"] < 1e-4  # fp32: only reordering separates them
            assert row["over_floor"] == row["median_us"] / rows[(shape, "collective_free")][
                "median_us"]
        if variant == "infini_dist":
            # all_reduce -> add -> rms_norm after o_proj and down_proj of both layers
            assert row["sites"] == 4 and row["pass_graphs"] == 1
            sites = sorted(d["site"] for d in row["decisions"])
            assert sites == ["all_reduce+add_rms_norm (1 out)", "all_reduce+add_rms_norm (2 out)"]
            for d in row["decisions"]:
                assert d["source"] == "tuned" and d["choice"] in d["times_us"]
                assert "native" in d["times_us"] and len(d["times_us"]) >= 2
    assert data["verdict"]["check_failures"] == []

    lines = [line for line in run.stdout.splitlines() if line.strip()]
    # The short summary table comes last: header, one row per shape, floor, target, correctness.
    assert lines[-6].split()[:5] == ["shape", "inductor", "+infini", "floor", "eager"]
    assert lines[-3].endswith("8 collective(s) replaced, none left")
    for line, shape in zip(lines[-5:-3], ("decode b2", "prefill 4")):
        assert line.strip().startswith(shape)
        b = rows[(shape, "infini_dist")]
        assert f"{b['median_us']:.1f}" in line and f"{b['rel_l2_vs_eager']:.2e}" in line
        assert f" {b['sites']} " in line
    assert lines[-2].startswith("target: infini_dist >= 1.15x")
    assert lines[-1] == "correctness: infini_dist vs eager, relative L2 <= 0.0001: ok"
    assert "infini_dist replaced 4 site(s) in 1 graph(s)" in run.stdout


def test_decode_attention_matches_a_plain_reference():
    """KV write at `pos`, GQA grouping and the mask: positions past `pos` must not matter."""
    cfg = ModelConfig(layers=1, hidden=32, mlp=64, heads=4, kv_heads=2, context=6)
    gen = torch.Generator().manual_seed(0)
    layer = tp_decoder.Layer(cfg, 1, gen, gen, torch.device("cpu"), torch.float32)
    b, d, pos = 3, layer.head_dim, 3
    h = torch.randn(b, 1, cfg.hidden, generator=gen, dtype=torch.float32)
    cache = [torch.randn(b, 2, cfg.context, d, generator=gen, dtype=torch.float32)
             for _ in "kv"]
    before = [c.clone() for c in cache]
    out = layer.attention(h, torch.tensor([pos]), cache)

    q, k, v = F.linear(h, layer.wqkv).split([4 * d, 2 * d, 2 * d], dim=-1)
    keys, values = (c[:, :, :pos].clone() for c in before)
    keys = torch.cat([keys, k.view(b, 1, 2, d).transpose(1, 2)], dim=2).repeat_interleave(2, 1)
    values = torch.cat([values, v.view(b, 1, 2, d).transpose(1, 2)], 2).repeat_interleave(2, 1)
    o = F.scaled_dot_product_attention(q.view(b, 1, 4, d).transpose(1, 2), keys, values)
    expected = F.linear(o.transpose(1, 2).reshape(b, 1, -1), layer.wo)
    torch.testing.assert_close(out, expected)
    # The new K/V landed at pos and nowhere else.
    assert torch.equal(cache[0][:, :, pos], k.view(b, 2, d))
    keep = [i for i in range(cfg.context) if i != pos]
    assert torch.equal(cache[1][:, :, keep], before[1][:, :, keep])
    # Garbage past pos changes nothing.
    cache[0][:, :, pos + 1:] = 1e3
    torch.testing.assert_close(layer.attention(h, torch.tensor([pos]), cache), expected)


def test_sizes_that_do_not_split_are_refused(monkeypatch, capsys):
    tp_decoder.check_shapes(ModelConfig(8, 4096, 14336, 32, 8, 1024), 4)  # the real run
    with pytest.raises(ValueError, match=r"--kv-heads 8 is not divisible by the tensor-parallel "
                                         r"size 3.*--mlp 14336 is not divisible"):
        tp_decoder.check_shapes(ModelConfig(8, 4096, 14336, 33, 8, 1024), 3)
    with pytest.raises(ValueError, match="--heads 6 is not a multiple of --kv-heads 4"):
        tp_decoder.check_shapes(ModelConfig(1, 48, 8, 6, 4, 8), 2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # checked before any process group exists
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--heads", "6", "--kv-heads", "2"])
    assert "--heads 6 is not divisible by the tensor-parallel size 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--variants", "inductor,nope"])


def _row(shape, variant, us, **extra):
    return dict(shape=shape.name, variant=variant, median_us=us, **extra)


def test_summary_verdict():
    class Args:
        tol = 1e-2
        variants = list(bench_model.VARIANTS)
    d1, d64, pre = Shape("decode", 1, 1), Shape("decode", 64, 1), Shape("prefill", 1, 2048)
    rows = [_row(d1, "inductor", 100.0, rel_l2_vs_eager=1e-3),
            _row(d1, "infini_dist", 90.0, rel_l2_vs_eager=5e-3, sites=16),  # 1.11x < 1.15x
            _row(d1, "eager", 120.0),
            _row(d64, "inductor", 100.0), _row(d64, "infini_dist", 99.0, rel_l2_vs_eager=2e-2),
            _row(d64, "eager", 110.0),
            _row(pre, "inductor", 1000.0), {"shape": pre.name, "variant": "infini_dist",
                                            "error": "first call: boom"},
            _row(pre, "eager", 1100.0)]
    lines, verdict = bench_model.summary(rows, [d1, d64, pre], Args, smoke=False)
    # decode b64 only must not lose; an error counts as a miss
    assert verdict["target_misses"] == ["decode b1: 1.11x < 1.15x",
                                        "prefill 2048: no speed-up (an error above)"]
    assert verdict["check_failures"] == ["decode b64: rel L2 2.00e-02 > 0.01",
                                         "prefill 2048: not checked (an error above)"]
    table = "\n".join(lines)
    assert "1.11x" in table and "error" in table and "NOT met" in table and "FAILED" in table
