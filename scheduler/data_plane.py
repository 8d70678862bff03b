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
import functools
import hashlib
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


def _bounded_call(name: str, call, tensor: torch.Tensor) -> None:
    limit = getattr(_LIMIT, "value", None)
    if limit is None or tensor.is_cuda:
        call()  # the plain blocking call, as the user's own code makes it
        return
    timeout_s, step = limit
    try:
        call(async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # gloo: timeout, or a peer that closed its connection
        raise DataPlaneError(
            f"infini_dist: rank {dist.get_rank()}: a data-plane {name} at tuning step "
            f"{step!r} did not complete within {timeout_s:.0f}s; a peer failed or left the "
            f"lockstep, and the group's collectives are out of step. Cause: {error}") from error


def all_reduce(tensor: torch.Tensor, group) -> None:
    _bounded_call("all_reduce", functools.partial(dist.all_reduce, tensor, group=group), tensor)


def reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """out = this rank's chunk (along dim 0) of the sum of `tensor` over the group."""
    _bounded_call("reduce_scatter", functools.partial(dist.reduce_scatter_tensor, out, tensor,
                                                      group=group), tensor)


def all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """out = every rank's `tensor`, in rank order along dim 0."""
    _bounded_call("all_gather", functools.partial(dist.all_gather_into_tensor, out, tensor,
                                                  group=group), tensor)


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


def digest(values: dict) -> str:
    """sha256 of named tensors' bytes: equal across ranks exactly when their bits are."""
    h = hashlib.sha256()
    for name in sorted(values):
        t = values[name].detach().cpu().reshape(-1)  # 1-d: a 0-d tensor has no byte view
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
