"""The control plane: small cross-rank exchanges on a CPU (gloo) group over the op's own ranks.

Every exchange has a timeout and names its step, so a rank that never arrives (crashed, skipped
tuning, different inputs) turns into a clear error on the others instead of a hang.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist


class ControlPlaneError(RuntimeError):
    pass


class RankMismatchError(ControlPlaneError):
    pass


class ControlPlane:
    """All-gather and broadcast of picklable objects among one group's ranks."""

    def __init__(self, group, timeout_s: float):
        self.data_group = group
        self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.rank = dist.get_rank(group)
        self.world_size = len(self.ranks)
        self.timeout_s = timeout_s
        self.group = self._gloo_group(group, timeout_s)

    def _gloo_group(self, group, timeout_s):
        # Our own group even over a gloo data group: its timeout is ours, not the user's.
        # use_local_synchronization: only these ranks take part, so a subgroup never waits on
        # ranks outside it (plain new_group is collective over WORLD).
        try:
            return dist.new_group(list(self.ranks), backend="gloo",
                                  timeout=datetime.timedelta(seconds=timeout_s),
                                  use_local_synchronization=True)
        except Exception as error:  # the store wait times out when a member never comes
            self._fail("control group setup", error)

    def _fail(self, step: str, error: Exception):
        raise ControlPlaneError(
            f"infini_dist: rank {self.rank} of group {list(self.ranks)} failed at step {step!r} "
            f"(timeout {self.timeout_s:.0f}s): some rank did not arrive or broke off. A rank may "
            f"have crashed, skipped this call, or been given different inputs. Cause: {error}"
        ) from error

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as error:  # gloo raises RuntimeError on timeout or a dead peer
            self._fail(step, error)
        return out

    def broadcast(self, obj: Any, step: str) -> Any:
        """Rank 0 of the group decides; everyone returns its object."""
        if self.world_size == 1:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        except Exception as error:
            self._fail(step, error)
        return box[0]

    def agree(self, obj: Any, step: str, what: str) -> Any:
        """All ranks must hold an equal obj; otherwise raise on every rank, naming the odd ones."""
        values = self.all_gather(obj, step)
        if all(v == values[0] for v in values):
            return obj
        odd = [self.ranks[i] for i, v in enumerate(values) if v != values[0]]
        detail = "; ".join(f"rank {self.ranks[i]}: {v}" for i, v in enumerate(values))
        raise RankMismatchError(f"infini_dist: ranks disagree on {what} at step {step!r}. "
                                f"Ranks {odd} differ from rank {self.ranks[0]}. {detail}")

    def barrier(self, step: str) -> None:
        self.all_gather(None, step)


_PLANES: dict[tuple, ControlPlane] = {}
_LOCK = threading.Lock()


def control_plane(group, timeout_s: float) -> ControlPlane:
    """One control plane per (ranks, timeout), built on first use by exactly the group's ranks."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (ranks, id(group or dist.group.WORLD), float(timeout_s))
    with _LOCK:
        plane = _PLANES.get(key)
        if plane is None:
            plane = _PLANES[key] = ControlPlane(group, timeout_s)
    return plane


def reset_control_planes() -> None:
    """Destroy the gloo groups the control planes made and forget them.

    Call on every rank before `destroy_process_group()`: groups left for interpreter teardown
    can abort the process while gloo's threads are still connected to peers."""
    with _LOCK:
        planes = list(_PLANES.values())
        _PLANES.clear()
    if dist.is_initialized():
        for plane in planes:
            try:
                dist.destroy_process_group(plane.group)
            except (ValueError, RuntimeError):
                pass  # already destroyed with everything else
