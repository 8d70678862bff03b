"""The test harnesses end what they start when a limit passes: a torchrun-style process group,
gloo ranks, and the interpreter's worker pool. A stuck rank or kernel fails its test and is
killed; it never holds the session (or CI) past the limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from interpreter_worker import closing_pool, run
from multirank import run_process, run_ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie waiting for its parent is gone too
        return handle.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pids, seconds=10.0) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_run_process_kills_the_whole_group_at_its_limit(tmp_path):
    pids = tmp_path / "pids"
    # an agent that starts a child, as torchrun starts its ranks, and both hang
    script = (f"import os, subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
              f"time.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process([sys.executable, "-c", script], timeout=5)
    assert time.monotonic() - started < 30
    assert not _wait_gone([int(p) for p in pids.read_text().split()])


def _hang_on_rank_1(rank, world_size, pid_dir):
    with open(os.path.join(pid_dir, str(rank)), "w") as handle:
        handle.write(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_ranks_kills_a_rank_that_does_not_finish(tmp_path):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish"):
        run_ranks(_hang_on_rank_1, 2, str(tmp_path), timeout=5)
    assert time.monotonic() - started < 40
    assert not _wait_gone([int((tmp_path / str(r)).read_text()) for r in range(2)])


def _pid_then_sleep(seconds):
    import os
    import time
    if seconds:
        time.sleep(seconds)
    return os.getpid()


def test_a_stuck_pool_task_kills_the_worker_and_the_pool_closes():
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing
    started = time.monotonic()
    with pytest.raises(Exception):
        with closing_pool(ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"))) as pool:
            worker = run(pool, _pid_then_sleep, 0)
            run(pool, _pid_then_sleep, 600, timeout=3)
    assert time.monotonic() - started < 60
    assert not _wait_gone([worker])


def test_a_job_that_cannot_tear_down_prints_its_stacks_and_exits():
    # launch.shutdown: the compiled code (and with it any CUDA graph that captured a collective)
    # goes before the process group; a teardown that waits anyway ends the process with stacks.
    script = """
import os, sys, time
import torch, torch.distributed as dist
import infini_dist.launch as launch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
order = []
reset, barrier = torch._dynamo.reset, dist.barrier
torch._dynamo.reset = lambda: (order.append("reset"), reset())
dist.barrier = lambda: (order.append("barrier"), barrier())
def stuck():
    print(" ".join(order), flush=True)
    time.sleep(600)
dist.destroy_process_group = stuck
launch.SHUTDOWN_LIMIT_S = 2
launch.shutdown()
"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    done = run_process([sys.executable, "-c", script, str(port)], timeout=120)
    assert done.returncode != 0 and time.monotonic() - started < 100
    assert done.stdout.split() == ["reset", "barrier"], done.stdout + done.stderr
    assert "Timeout" in done.stderr and "stuck" in done.stderr, done.stderr[-2000:]
