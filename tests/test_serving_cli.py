"""`infini-dist tune` under torchrun on 2 CPU ranks, and `infini-dist cache list | show | clear`
on the decisions it wrote (and on a corrupt and a stale file)."""

from __future__ import annotations

import json
import os
import sys

from infini_dist.launch import cache_cli, cli
from multirank import run_process
from infini_dist.scheduler.cache import DECISIONS


def test_tune_then_list_show_and_clear(tmp_path, capsys, isolated_cache):
    cache = isolated_cache  # config.cache_dir: what the CLI reads without --cache-dir
    env = dict(os.environ, INFINI_DIST_CACHE_DIR=str(cache), INFINI_DIST_BENCHMARK_REPS="2",
               INFINI_DIST_BENCHMARK_WARMUP="1")
    done = run_process([sys.executable, "-m", "infini_dist.launch.cli", "tune", "--nproc", "2",
                        "--model", "tp_decoder", "--tokens", "3,5,8", "--hidden", "16",
                        "--mlp", "32", "--heads", "4", "--kv-heads", "2",
                        "--backend", "infini_dist"],
                        env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # 3 and 5, 8 fall in two buckets (4 and 8): each site is tuned once per bucket, on rank 0's
    # bar. The norms' eps is a graph input under dynamic=True, read at run time; the layer's
    # two sites differ (the last one's residual is read by nothing).
    assert "infini-dist tune: 3 token counts, 4 site(s) tuned" in done.stdout
    assert done.stderr.count("infini_dist: tuned all_reduce+add_rms_norm tokens<=") == 4
    assert "infini_dist warm-up: 100%" in done.stderr  # rank 0's bar (test_serving: only)
    keys = sorted(p.stem for p in cache.glob("*.json"))
    assert len(keys) == 4

    # A corrupt file and one from other versions are listed too, marked.
    (cache / "ffff0000corrupt.json").write_text("{not json")
    stale = json.loads((cache / f"{keys[0]}.json").read_text())
    stale["versions"] = dict(stale["versions"], torch="0.0")
    (cache / "eeee0000stale.json").write_text(json.dumps(stale))

    assert cli.main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    lines = {line.split()[0]: line for line in listing.splitlines()[1:-1]}
    assert set(lines) == {k[:12] for k in keys} | {"ffff0000corr", "eeee0000stal"}
    for key in keys:
        record = json.loads((cache / f"{key}.json").read_text())
        assert record["bucket"] in (4, 8) and record["world_size"] == 2
        fields = lines[key[:12]].split()
        assert fields[1:5] == ["all_reduce+add_rms_norm", str(record["bucket"]),
                               "float32/float32/float32", record["choice"]]
        assert "(stale)" not in lines[key[:12]]
    assert "(unreadable)" in lines["ffff0000corr"] and "(stale)" in lines["eeee0000stal"]
    assert "6 decision(s)" in listing

    assert cli.main(["cache", "show", keys[1][:8]]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((cache / f"{keys[1]}.json")
                                                             .read_text())
    assert cache_cli.main(["show", "0123abc"]) == 2  # matches nothing
    assert cache_cli.main(["clear", keys[0][:10], "nosuchkey"]) == 2  # nothing removed
    assert len(list(cache.glob("*.json"))) == 6
    assert cache_cli.main(["--cache-dir", str(cache), "clear", keys[0][:10]]) == 0
    assert not (cache / f"{keys[0]}.json").exists() and len(list(cache.glob("*.json"))) == 5
    assert cache_cli.main(["clear"]) == 0
    assert list(cache.glob("*.json")) == []
    capsys.readouterr()
    assert cache_cli.main(["list"]) == 0 and "no decisions" in capsys.readouterr().out
    assert len(DECISIONS) == 0  # the CLI never touches the in-process cache


def test_tune_hf_family_from_its_config(tmp_path):
    """`infini-dist tune --hf llama` builds the model from a config as `bench --hf` does (random
    weights, transformers' TP on 2 gloo ranks) and tunes its sites once per bucket."""
    import pytest
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' TP loading needs it
    cache = tmp_path / "decisions"
    env = dict(os.environ, INFINI_DIST_CACHE_DIR=str(cache), INFINI_DIST_BENCHMARK_REPS="2",
               INFINI_DIST_BENCHMARK_WARMUP="1",
               TORCHINDUCTOR_COMPILE_THREADS="1", HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    done = run_process([sys.executable, "-m", "infini_dist.launch.cli", "tune", "--nproc", "2",
                        "--hf", "llama", "--tokens", "3,5", "--layers", "1", "--hidden", "64",
                        "--mlp", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256"],
                        env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in cache.glob("*.json")]
    # embedding all_reduce -> input norm, o_proj -> add + norm, down_proj -> add + final norm:
    # distinct sites of a sharded model, each decided for buckets 4 and 8 only
    assert records and {r["bucket"] for r in records} == {4, 8}
    assert all(r["world_size"] == 2 and r["op"].startswith("all_reduce") for r in records)
    tuned = len(records)
    assert f"infini-dist tune: 2 token counts, {tuned} site(s) tuned" in done.stdout
    # the model directory rank 0 wrote is gone
    assert not any(p.name.startswith("llama-") for p in tmp_path.iterdir())


def test_cache_cli_reads_records_as_the_engine_does(tmp_path, capsys):
    """A FIFO, a directory or deep JSON named like a record lists as unreadable: never a hang."""
    from infini_dist.launch import cache_cli
    os.mkfifo(tmp_path / "aaaa0000fifo.json")
    (tmp_path / "bbbb0000dir0.json").mkdir()
    (tmp_path / "cccc0000deep.json").write_text("[" * 100000 + "]" * 100000)
    assert cache_cli.main(["--cache-dir", str(tmp_path), "list"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert len(rows) == 3 and all("(unreadable)" in row for row in rows), rows
    assert cache_cli.main(["--cache-dir", str(tmp_path), "show", "aaaa"]) == 2
