"""Run functions in a child process where Triton interprets our kernels on the CPU.

TRITON_INTERPRET=1 must be set before Triton makes a kernel, and the stand-in CPU driver that
`infini_dist.kernels.nt_runtime` installs is process-wide. Both stay in the child, so the pytest
process, and every other test module it runs (GPU ones included), is left untouched. Each pool
has its own HOME, so ninetoothed's generated-source cache (~/.ninetoothed) is private to it and
pytest-xdist workers never share one.

Functions sent to the pool must be module-level; tensors go both ways by pickling.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata


def _version(package: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in re.findall(r"\d+", metadata.version(package))[:2])
    except metadata.PackageNotFoundError:
        return ()


def interpreter_unusable() -> str | None:
    """Why Triton's interpreter cannot run here, or None. (Triton 3.6's interpreter breaks with
    numpy >= 2.4, the combination on the GPU image; the GPU tests cover the kernels there.)"""
    triton, numpy = _version("triton"), _version("numpy")
    if not triton or not numpy:
        return "triton or numpy is not installed"
    if triton < (3, 9) and numpy >= (2, 4):
        return f"Triton {triton} interpreter does not work with numpy {numpy}"
    return None


def _start(home: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HOME"] = home
    import torch
    torch.set_num_threads(1)
    from interpreter_patches import install
    install()


def kill_workers(pool) -> None:
    """Kill `pool`'s processes now: a task stuck in one (a kernel that never returns) would
    otherwise hold every later task and the pool's shutdown, and so the test session. The pool
    is broken afterwards: later submits fail at once."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()


@contextlib.contextmanager
def closing_pool(pool):
    """`pool` for a with-block: shut down at its end; where the block raised (a test's time
    limit, a result that timed out), its workers are killed first instead of waited for."""
    try:
        yield pool
        pool.shutdown(wait=True, cancel_futures=True)
    except BaseException:  # also a time limit that fires while the shutdown waits
        kill_workers(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        raise


def interpreter_pool(home: str):
    os.makedirs(home, exist_ok=True)
    return closing_pool(ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
        initargs=(str(home),)))


def run(pool, fn, *args, timeout: float = 300.0, **kwargs):
    """fn(*args, **kwargs) in the interpreter process; its exceptions re-raise here. Past
    `timeout`, or when the test is stopped meanwhile, the worker is killed (see kill_workers)."""
    future = pool.submit(fn, *args, **kwargs)
    try:
        return future.result(timeout=timeout)
    except BaseException:
        if not future.done():
            kill_workers(pool)
        raise


def call_kernel(module: str, function: str, *args, **kwargs):
    """`infini_dist.kernels.<module>.<function>(*args, **kwargs)`, in the interpreter process."""
    import importlib
    return getattr(importlib.import_module(f"infini_dist.kernels.{module}"), function)(*args,
                                                                                       **kwargs)
