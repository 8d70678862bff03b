"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Rendezvous goes through a file in a temp dir, so parallel tests (pytest -n) never fight over
ports, and every run gets its own decision-cache dir unless the caller passes one.

Ranks fork from a forkserver that has imported torch once (per pytest worker) instead of each
starting a fresh interpreter: that import was most of a small multi-rank test's cost. Only
modules that read no setting a test may vary are preloaded (not infini_dist, Dynamo, Inductor or
Triton, which read environment variables on import); each rank then gets the caller's whole
environment plus `env` before the test's function and arguments are unpickled, so a module they
import sees the same settings a freshly spawned process would.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


PRELOAD = ["torch", "torch.distributed"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when this process's forkserver starts
    return ctx


def _set_environ(environ: dict) -> dict:
    os.environ.clear()
    os.environ.update(environ)
    return environ


class _Environ(dict):
    """A rank's whole environment. Passed first among the process arguments: unpickling it sets
    os.environ (a forkserver child starts with the forkserver's), before unpickling the function
    and its arguments imports the test's module."""

    def __reduce__(self):
        return _set_environ, (dict(self),)


def _entry(environ, rank, world_size, init_file, cache_dir, fn, args, queue, backend):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if environ.get("TRITON_INTERPRET") == "1":
        from interpreter_patches import install
        install()
    try:
        options = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            options["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=__import__("datetime").timedelta(seconds=180), **options)
        import infini_dist
        infini_dist.config.cache_dir = cache_dir
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; the queue's own pickler would share their memory,
        # which vanishes when this process exits before the parent reads it.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as error:  # report, never hang the parent
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        try:
            from infini_dist.scheduler.control import reset_control_planes
            reset_control_planes()
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world_size: int = 2, *args, cache_dir: str | None = None,
              timeout: float = 300.0, env: dict | None = None, backend: str = "gloo",
              partial: bool = False) -> list:
    """Returns each rank's result (rank order). Raises if a rank raised or did not finish.

    `fn(rank, world_size, *args)` must be a module-level function (it is pickled). With
    backend="nccl", rank r runs on cuda:r. With partial=True a rank that exits without a result
    (a fault test kills it) gives None instead, once the others have reported."""
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = cache_dir or os.path.join(tmp, "cache")
        init_file = os.path.join(tmp, "rendezvous")
        environ = _Environ({**os.environ, **(env or {}), "INFINI_DIST_CACHE_DIR": cache_dir,
                            **(SAFE_GPU_ENV if backend == "nccl" else {})})
        procs = [ctx.Process(target=_entry, args=(environ, r, world_size, init_file, cache_dir,
                                                  fn, args, queue, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                try:
                    rank, status, value = queue.get(timeout=1.0)
                    results[rank] = (status, value)
                    continue
                except queue_module.Empty:
                    pass
                # A rank that died without reporting (killed, crashed) will never report.
                dead = [r for r, p in enumerate(procs) if r not in results and
                        p.exitcode is not None]
                if partial:
                    if len(results) + len(dead) == world_size and queue.empty():
                        break
                elif dead and queue.empty():
                    time.sleep(1.0)
                    if queue.empty():
                        raise RuntimeError(f"ranks {dead} exited (codes "
                                           f"{[procs[r].exitcode for r in dead]}) without a result")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} "
                                       f"did not finish within {timeout}s")
        finally:  # ranks that have not reported (a timeout, a stopped test) are killed now
            for p in procs:
                p.join(timeout=10 if len(results) == world_size else 0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RuntimeError("rank failures:\n" + "\n".join(f"[rank {r}] {v}"
                                                          for r, v in sorted(errors.items())))
    return [pickle.loads(results[r][1]) if r in results else None for r in range(world_size)]


def run_process(argv: list[str], *, timeout: float, env: dict | None = None,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """`argv` with its output captured, in a process group of its own: when `timeout` passes, or
    the test is stopped (pytest-timeout, ^C), the whole group is killed, torchrun's ranks
    included, so no rank outlives its test. A timeout raises subprocess.TimeoutExpired with the
    output so far."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        raise
    finally:  # a rank left behind by an agent that exited early
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def launch_env(tmp_path, **env: str) -> dict:
    """This environment with short tuning and a decision cache of its own under `tmp_path`, for
    a launched job; `env` adds or overrides (a GPU job may want Inductor's parallel compile
    back: one compile thread is for the 2-core CPU machines). Inductor's cache is the session's
    (tests/conftest.py): compiled code shared, no FX graph cache to skip the pass."""
    return {**os.environ, "INFINI_DIST_CACHE_DIR": str(tmp_path / "decisions"),
            "INFINI_DIST_BENCHMARK_REPS": "2", "INFINI_DIST_BENCHMARK_WARMUP": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "1", **env}


def run_cli(tmp_path, *argv: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """`infini-dist <argv>` in a subprocess (torchrun under it for --nproc), with launch_env."""
    return run_process([sys.executable, "-m", "infini_dist.launch.cli", *argv],
                       env=launch_env(tmp_path, **env), timeout=timeout)
