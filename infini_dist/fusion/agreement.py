"""Routing agreed across ranks: a collective graph is routed (fused or unfused) only after every
rank of its group has the same route for the same graph and input signature.

The route is a pure function of the graph, the signature and the configs, but those are per
rank: shapes that differ across ranks, or a FusionConfig / infini_dist.config that differs, would
send one rank into the engine's tuning exchanges and another into a plain all_reduce, each
waiting for the other. So the ranks exchange (graph, signature, route) on the control plane
before any rank runs a collective; a mismatch raises RankMismatchError on every rank.

When: on every route-cache miss, and on every call where calls are agreed
(agree_every_call, scheduler/every_call.py), cache hit or not. With calls not agreed, a rank
that meets a signature its peers have cached waits at step 'route' and raises
ControlPlaneError within tuning_timeout_s (naming the flag); its peers' collective fails only
when that rank gives up or at the process group's own timeout.
"""

from __future__ import annotations

from infini_dist.scheduler import every_call
from infini_dist.scheduler.control import control_plane
from infini_dist.scheduler.ir import SubGraph


def route_key(graph: SubGraph, signature: tuple, path: str) -> tuple:
    """What the ranks compare: graph, input signature ((shape, dtype) per input), route path."""
    return (graph.signature(), [[list(shape), str(dtype)] for shape, dtype in signature], path)


def agree_route(key: tuple, reason: str, group, timeout_s: float) -> None:
    """Raise RankMismatchError on every rank of `group` unless all hold the same route key."""
    every_call.agree_key(control_plane(group, timeout_s), key, reason, "route",
                         "routes (their FusionConfig or infini_dist.config differ)")
