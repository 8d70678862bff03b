"""Data-plane collectives, bounded while a site tunes.

During tuning every rank runs the same choices in lockstep; a rank that fails before its
collective leaves its peers inside theirs. While `bounded` is active, a CPU collective waits at
most the given time and then raises `DataPlaneError` naming the tuning step, so the peers reach
the next control exchange and every rank fails with a clear error. CUDA collectives keep their
own semantics (stream-ordered; the NCCL watchdog bounds them).
"""

from __future__ import annotations

import contextlib
import datetime
import threading

import torch
import torch.distributed as dist

from infini_dist.scheduler.control import ControlPlaneError


class DataPlaneError(ControlPlaneError):
    """A collective did not complete: ranks are out of step on the data group, which cannot be
    trusted for the rest of this tuning."""


_LIMIT = threading.local()


@contextlib.contextmanager
def bounded(timeout_s: float, step: str):
    previous = getattr(_LIMIT, "value", None)
    _LIMIT.value = (timeout_s, step)
    try:
        yield
    finally:
        _LIMIT.value = previous


def all_reduce(tensor: torch.Tensor, group) -> None:
    limit = getattr(_LIMIT, "value", None)
    if limit is None or tensor.is_cuda:
        dist.all_reduce(tensor, group=group)
        return
    timeout_s, step = limit
    try:
        dist.all_reduce(tensor, group=group, async_op=True).wait(
            datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # gloo: timeout, or a peer that closed its connection
        raise DataPlaneError(
            f"infini_dist: rank {dist.get_rank()}: a data-plane all_reduce at tuning step "
            f"{step!r} did not complete within {timeout_s:.0f}s; a peer failed or left the "
            f"lockstep, and the group's collectives are out of step. Cause: {error}") from error


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def guarded(run, values: dict):
    """(call, state): call() runs the choice and records its first failure instead of raising,
    so a failing rank keeps making the same calls as its peers and the failure is agreed after
    the timing. After a data-plane failure it stops: every further collective would wait too."""
    state = {"error": None, "broken": False}

    def call():
        if state["broken"]:
            return
        try:
            run(values)
        except DataPlaneError as error:
            state["error"], state["broken"] = describe(error), True
        except Exception as error:  # noqa: BLE001 - agreed on after the timing
            state["error"] = state["error"] or describe(error)
    return call, state
