"""The control plane: small cross-rank exchanges on a CPU (gloo) group over the op's own ranks.

Every exchange has a timeout and names its step, so a rank that never arrives (crashed, skipped
tuning, different inputs) turns into a clear error on the others instead of a hang.

The gloo group is built outside torch's group bookkeeping: `dist.new_group` names its store keys
from per-process counters, which differ on ranks that were not in an earlier group, so any mix of
groups could hang at setup. Here the store prefix depends only on the sorted ranks, the timeout
and how many times this process built a plane for them, which every member counts alike.
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

    def __init__(self, ranks: tuple[int, ...], timeout_s: float, generation: int):
        if dist.get_rank() not in ranks:
            raise ValueError(f"infini_dist: rank {dist.get_rank()} is not in group {list(ranks)}")
        self.ranks = ranks
        self.rank = ranks.index(dist.get_rank())
        self.world_size = len(ranks)
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self.broken = False
        self._timeout = datetime.timedelta(seconds=timeout_s)
        prefix = f"infini_dist/control/{'-'.join(map(str, ranks))}/{timeout_s!r}/{generation}/"
        try:
            store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, self._timeout)
        except Exception as error:  # the store wait times out when a member never comes
            self._fail("control group setup", error)
        self.hosts = tuple(self.all_gather(host_id(), "host identity"))
        self.single_host = len(set(self.hosts)) == 1

    def _fail(self, step: str, error: Exception):
        # A failed exchange may leave an operation pending in gloo: never reuse this plane.
        self.broken = True
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
_GENERATIONS: dict[tuple, int] = {}  # never reset, so a rebuilt plane gets fresh store keys
_BROKEN: list[ControlPlane] = []  # kept alive: freeing one joins gloo threads still waiting
_BUILDING: dict[tuple, threading.Lock] = {}  # one build per key at a time, one generation each
_LOCK = threading.Lock()


def _forget(plane: ControlPlane) -> None:
    with _LOCK:
        key = (plane.ranks, plane.timeout_s)
        if _PLANES.get(key) is plane:
            del _PLANES[key]
        _BROKEN.append(plane)


def control_plane(group, timeout_s: float) -> ControlPlane:
    """One control plane per (ranks, timeout), built on first use by exactly the group's ranks."""
    ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
    key = (ranks, float(timeout_s))
    with _LOCK:
        building = _BUILDING.setdefault(key, threading.Lock())
    with building:  # not under _LOCK: a build waits for the peers, other groups must not
        with _LOCK:
            plane = _PLANES.get(key)
            if plane is not None:
                return plane
            generation = _GENERATIONS[key] = _GENERATIONS.get(key, -1) + 1
        plane = ControlPlane(ranks, float(timeout_s), generation)
        with _LOCK:
            _PLANES[key] = plane
        return plane


def reset_control_planes() -> None:
    """Forget the control planes (their gloo groups close when freed).

    Call on every rank before `destroy_process_group()`, so that no gloo group outlives the
    store it was built on."""
    with _LOCK:
        _PLANES.clear()
        _BROKEN.clear()
