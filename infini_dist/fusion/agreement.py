"""Routing agreed across ranks: a collective graph is routed (fused or unfused) only after every
rank of its group has the same route for the same graph and input signature.

The route is a pure function of the graph, the signature and the configs, but those are per
rank: shapes that differ across ranks, or a FusionConfig / infini_dist.config that differs, would
send one rank into the engine's tuning exchanges and another into a plain all_reduce, each
waiting for the other. So on a route-cache miss the ranks exchange (graph, signature, route)
once on the control plane; a mismatch raises RankMismatchError on every rank, before any rank
runs a collective. Cache hits exchange nothing.

What is guaranteed: ranks that meet a signature for the first time together agree or fail
together. A rank that meets a signature its peers do not (its peers take their cached route for
another signature) waits at step 'route' and raises ControlPlaneError within tuning_timeout_s;
its peers' collective then fails when that rank gives up (its process group goes away) or at
the process group's own timeout. Only an exchange on every call could bound that side as well.
"""

from __future__ import annotations

from infini_dist.scheduler.control import RankMismatchError, control_plane
from infini_dist.scheduler.ir import SubGraph


def agree_route(graph: SubGraph, signature: tuple, path: str, reason: str, group,
                timeout_s: float) -> None:
    """Raise RankMismatchError on every rank of `group` unless all hold the same graph,
    input signature ((shape, dtype) per input) and route path."""
    plane = control_plane(group, timeout_s)
    mine = (graph.signature(), [(list(shape), str(dtype)) for shape, dtype in signature], path)
    gathered = plane.all_gather((mine, reason), "route")
    if all(key == mine for key, _ in gathered):
        return
    first = gathered[0][0]
    what = ("graphs" if any(key[0] != first[0] for key, _ in gathered) else
            "input shapes or dtypes" if any(key[1] != first[1] for key, _ in gathered) else
            "routes (their FusionConfig or infini_dist.config differ)")
    odd = [plane.ranks[i] for i, (key, _) in enumerate(gathered) if key != first]
    detail = "; ".join(f"rank {plane.ranks[i]}: inputs {key[1]} -> {key[2]} ({why})"
                       for i, (key, why) in enumerate(gathered))
    raise RankMismatchError(f"infini_dist.fusion: ranks disagree on {what} at step 'route'. "
                            f"Ranks {odd} differ from rank {plane.ranks[0]}. {detail}")
