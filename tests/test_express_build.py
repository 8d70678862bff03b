"""Building the eager ops' C++ module (kernels/express.py) can never block a user: a builder
that was killed leaves torch's lock file behind, and the next build must not wait on it; a
lock held too long by a live process ends in the Python path with one warning, never a hang.
The module is built for real (one module serves CPU tests and GPUs)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from infini_dist.kernels import express

pytestmark = pytest.mark.timeout(600)  # a first compile of the module on a busy 2-core machine

_HOLD = """
import fcntl, os, sys, time
directory = sys.argv[1]
os.makedirs(directory, exist_ok=True)
handle = open(directory + ".flock", "a")
fcntl.flock(handle, fcntl.LOCK_EX)
open(os.path.join(directory, "lock"), "w").close()   # torch's baton, as a live builder has it
print("holding", flush=True)
time.sleep(600)
"""


def _holder(directory: str) -> subprocess.Popen:
    """A process holding the build lock, as a builder in the middle of its compile does."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, directory], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def _build_in_thread(wait_s: float, **kwargs):
    result = {}

    def run():
        try:
            result["module"] = express.build(**kwargs)
        except Exception as error:
            result["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    assert not thread.is_alive(), f"the build still waits after {wait_s} s"
    return result


def test_a_killed_builder_does_not_block_the_next_build():
    # the machine's own build folder: its cached build (test_express.py's) loads in seconds;
    # the holder takes the lock like any builder, so it waits for one in progress
    directory = express.build_directory()
    holder = _holder(directory)
    holder.send_signal(signal.SIGKILL)  # killed mid-build: torch's `lock` file stays behind
    holder.wait()
    assert os.path.exists(os.path.join(directory, "lock"))
    result = _build_in_thread(540)
    if "error" in result and "lock" not in str(result["error"]):
        pytest.skip(f"no C++ toolchain here: {result['error']}")
    assert "module" in result, result
    assert result["module"].size() == 0
    assert not os.path.exists(os.path.join(directory, "lock"))


def test_a_lock_held_too_long_means_the_python_path_with_one_warning(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv("INFINI_DIST_EXPRESS_DIR", str(tmp_path / "express"))
    holder = _holder(express.build_directory())
    try:
        started = time.monotonic()
        result = _build_in_thread(30, timeout_s=1.0)
        assert isinstance(result.get("error"), TimeoutError), result
        assert time.monotonic() - started < 20
        # start(): the same, in its background thread, as one warning; no module, no raise
        monkeypatch.setattr(express, "_state", {"module": None, "thread": None, "error": None,
                                                "cleared": 0})
        monkeypatch.setattr(express, "BUILD_TIMEOUT_S", 1.0)
        with caplog.at_level(logging.WARNING, logger="infini_dist"):
            assert express.start(wait=True) is None
        warnings = [r for r in caplog.records if "Python path" in r.getMessage()]
        assert len(warnings) == 1 and "TimeoutError" in warnings[0].getMessage()
        assert express.module() is None
    finally:
        holder.kill()
        holder.wait()


def test_the_build_starts_when_the_eager_ops_are_imported_on_a_cuda_machine(monkeypatch):
    """A fresh machine's build (about 2 s) starts at `import infini_dist.ops` where it
    will serve, so a job's setup hides it; never on a machine without CUDA or with the flag
    off."""
    import torch

    import infini_dist
    from infini_dist.scheduler import cpp_launch
    started = []
    monkeypatch.setattr(express, "start", lambda *args, **kwargs: started.append(args))
    settings = infini_dist.config.snapshot()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpp_launch.start_early(settings)
    assert started == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cpp_launch.start_early(settings)
    assert started == [()]
    monkeypatch.setattr(infini_dist.config, "express_ops", False)
    cpp_launch.start_early(infini_dist.config.snapshot())
    assert started == [()]
    # the import calls it: a fresh interpreter that sees CUDA starts the build at the import
    probe = ("import torch\n"
             "torch.cuda.is_available = lambda: True\n"
             "torch.version.cuda = '13.0'\n"
             "from infini_dist.kernels import express\n"
             "express.start = lambda *a, **k: print('build started')\n"
             "import infini_dist.ops\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "build started", run.stderr[-2000:]
