"""The sweep's peers and the eager benchmark on two GPUs (issue #25): NCCL's symmetric kernels
in a process of their own, checked against the fp32 reference before they are timed, and the
eager benchmark's first-minute mode, which says which path served each call."""

import json
import os
import sys

import pytest

from multirank import SAFE_GPU_ENV, run_process

pytestmark = pytest.mark.multigpu


def _torchrun(tmp_path, module, *argv, timeout):
    env = dict(os.environ, **SAFE_GPU_ENV, INFINI_DIST_CACHE_DIR=str(tmp_path / "decisions"))
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", "-m", module, *argv], env=env, timeout=timeout,
                       cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_nccl_symmetric_peer_rows(tmp_path):
    _torchrun(tmp_path, "infini_dist.launch.peers_nccl_symm", "--tokens", "1,16",
              "--patterns", "add_rms_norm,relu_scale", "--trials", "1", "--replays", "5",
              "--out", str(tmp_path / "out"), timeout=200)
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert {(r["pattern"], r["tokens"], r["impl"]) for r in rows} == {
        (p, t, impl) for p in ("add_rms_norm", "relu_scale") for t in (1, 16)
        for impl in ("nccl_symm_ar", "nccl_symm")}
    assert all(r["graph_us"] > 0 and r["eager_us"] > 0 for r in rows), rows


def test_eager_first_minute_names_the_path(tmp_path):
    out = _torchrun(tmp_path, "infini_dist.launch.bench_eager", "--first-minute", "3",
                    "--tokens", "1,16", timeout=200)
    rows = [line.split("|") for line in out.splitlines()
            if line.startswith("| 1") and " s: " in line]
    assert rows, out[-3000:]
    paths = {cells[3].strip() for cells in rows}
    assert paths <= {"C++", "Python", "NCCL"} and "NCCL" in paths and paths - {"NCCL"}, paths
    for cells in rows:  # host, device and loop µs per call, all measured
        assert all(float(v) > 0 for v in cells[4:7]), cells
