import os
import sys

from multirank import run_process


def run_demo(cache_dir, *extra):
    env = dict(os.environ, INFINI_DIST_CACHE_DIR=str(cache_dir), INFINI_DIST_BENCHMARK_REPS="3")
    return run_process([sys.executable, "-m", "infini_dist.launch.cli", "demo", "--nproc", "2",
                        *extra], env=env, timeout=240)


def test_demo_tunes_then_hits_the_cache(tmp_path):
    first = run_demo(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    for site in ("all_reduce_add_rms_norm", "all_reduce_relu_scale"):
        assert f"site {site}  (tuned)" in out
    assert out.count("<- committed") == 2 and "native" in out
    assert "torch_fused[p0,e1]" in out
    assert "2 site(s) tuned" in out
    error = float(out.rsplit("max error vs unfused", 1)[1].split()[0])
    assert error < 1e-4

    second = run_demo(tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "site all_reduce_add_rms_norm  (from the cache)" in second.stdout
    assert "nothing was tuned" in second.stdout


def test_demo_compile_runs_the_block_through_the_pass(tmp_path):
    done = run_demo(tmp_path, "--compile", "--layers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "site all_reduce+add_rms_norm  (tuned)" in done.stdout
    assert "site all_reduce+relu+scale  (tuned)" in done.stdout
    relative = float(done.stdout.rsplit("(", 1)[1].split()[0])
    assert relative < 1e-5
