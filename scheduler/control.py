"""The control plane: small cross-rank exchanges on a CPU (gloo) group over the op's own ranks.

Every exchange has a timeout and names its step, so a rank that never arrives (crashed, skipped
tuning, different inputs) turns into a clear error on the others instead of a hang.

The gloo group is built outside torch's group bookkeeping: `dist.new_group` names its store keys
from per-process counters, which differ on ranks that were not in an earlier group, so any mix of
groups could hang at setup. Here the store prefix depends only on the sorted ranks, the timeout
and an epoch kept in the store itself. A rank whose exchange fails abandons the plane and moves
the epoch on; its peers see the new epoch before their next tuning and rebuild with it, so the
members of a group meet again even when only some of them saw the failure.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist


class ControlPlaneError(RuntimeError):
    pass


class RankMismatchError(ControlPlaneError):
    pass


def host_id() -> str:
    """Ranks with the same id share a host (and may use NVLink-only algorithms together).
    The kernel's boot id is shared by every container on one host and differs across hosts,
    unlike hostnames; INFINI_DIST_HOST_ID overrides it (CPU tests fake two hosts with it)."""
    override = os.environ.get("INFINI_DIST_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class ControlPlane:
    """All-gather and broadcast of picklable objects among one group's ranks.

    `lock` serialises whole tunings on this plane: two threads tuning at once would otherwise
    interleave their exchanges."""

    def __init__(self, ranks: tuple[int, ...], timeout_s: float, epoch: int):
        if dist.get_rank() not in ranks:
            raise ValueError(f"infini_dist: rank {dist.get_rank()} is not in group {list(ranks)}")
        self.ranks = ranks
        self.rank = ranks.index(dist.get_rank())
        self.world_size = len(ranks)
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self.epoch = epoch
        self._timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.PrefixStore(f"{_base(ranks, timeout_s)}/{epoch}/", _store())
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, self._timeout)
        except Exception as error:  # the store wait times out when a member never comes
            self._fail("control group setup", error)
        self.hosts = tuple(self.all_gather(host_id(), "host identity"))
        self.single_host = len(set(self.hosts)) == 1

    def _fail(self, step: str, error: Exception):
        # A failed exchange may leave an operation pending in gloo: never reuse this plane.
        _forget(self)
        raise ControlPlaneError(
            f"infini_dist: rank {self.rank} of group {list(self.ranks)} failed at step {step!r} "
            f"(timeout {self.timeout_s:.0f}s): some rank did not arrive or broke off. A rank may "
            f"have crashed, skipped this call, or been given different inputs. Cause: {error}"
        ) from error

    def _allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._pg.allgather([out], [tensor]).wait(self._timeout)
        return out

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        payload = pickle.dumps(obj)
        try:
            sizes = self._allgather(torch.tensor([len(payload)], dtype=torch.int64))
            buffer = torch.zeros(max(int(s) for s in sizes), dtype=torch.uint8)
            buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            gathered = self._allgather(buffer)
        except Exception as error:  # gloo raises RuntimeError on timeout or a dead peer
            self._fail(step, error)
        return [pickle.loads(t[:int(s)].numpy().tobytes()) for t, s in zip(gathered, sizes)]

    def broadcast(self, obj: Any, step: str) -> Any:
        """Rank 0 of the group decides; everyone returns its object."""
        return self.all_gather(obj if self.rank == 0 else None, step)[0]

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
_BROKEN: list[ControlPlane] = []  # kept alive: freeing one joins gloo threads still waiting
_BUILDING: dict[tuple, threading.Lock] = {}  # one build per key at a time
_LOCK = threading.Lock()


def _store():
    return dist.distributed_c10d._get_default_store()


def _base(ranks, timeout_s) -> str:
    return f"infini_dist/control/{'-'.join(map(str, ranks))}/{timeout_s!r}"


def _epoch(ranks, timeout_s) -> int:
    return _store().add(f"{_base(ranks, timeout_s)}/epoch", 0)


def _forget(plane: ControlPlane) -> None:
    """Abandon the plane and move its epoch on (only the first of several ranks to abandon
    one epoch moves it, so they all meet at the next)."""
    with _LOCK:
        key = (plane.ranks, plane.timeout_s)
        if _PLANES.get(key) is plane:
            del _PLANES[key]
        _BROKEN.append(plane)
    try:
        _store().compare_set(f"{_base(*key)}/epoch", str(plane.epoch), str(plane.epoch + 1))
    except Exception:  # noqa: BLE001 - the store is gone: nothing will be rebuilt on it anyway
        pass


def control_plane(group, timeout_s: float) -> ControlPlane:
    """One control plane per (ranks, timeout), built on first use by exactly the group's ranks,
    and rebuilt when a peer abandoned it."""
    ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
    key = (ranks, float(timeout_s))
    with _LOCK:
        building = _BUILDING.setdefault(key, threading.Lock())
    with building:  # not under _LOCK: a build waits for the peers, other groups must not
        epoch = _epoch(*key)
        with _LOCK:
            plane = _PLANES.get(key)
        if plane is not None and plane.epoch == epoch:
            return plane
        if plane is not None:
            with _LOCK:
                _PLANES.pop(key, None)
                _BROKEN.append(plane)
        plane = ControlPlane(ranks, float(timeout_s), epoch)
        with _LOCK:
            _PLANES[key] = plane
        return plane


def reset_control_planes() -> None:
    """Forget the control planes (their gloo groups close when freed), moving their epochs on.

    Call on every rank before `destroy_process_group()`, so that no gloo group outlives the
    store it was built on."""
    with _LOCK:
        planes = list(_PLANES.values())
        _PLANES.clear()
    for plane in planes:
        _forget(plane)
    with _LOCK:
        _BROKEN.clear()
