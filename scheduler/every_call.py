"""Per-call agreement (infini_dist.config.agree_every_call): ranks exchange a call's key before
any of them acts on it, cache hit or not.

Routes and decisions are agreed when they are made, but a rank that finds its route or decision
cached goes straight into its data-plane collective, while a peer whose signature is new waits on
the control plane for an exchange the cached rank never makes: the peer times out, the cached
rank stays in its collective until the process group's own timeout. Agreeing every call closes
that gap, at one small control-plane exchange per call (what torch does for plain collectives
under TORCH_DISTRIBUTED_DEBUG=DETAIL). "auto" takes it where it is cheap next to the collective
(CPU tensors: the data plane is gloo too) or asked for (DETAIL); CUDA graphs replay no host code,
so nothing is added there.

A key is (what, inputs, decision): what is the graph or site, inputs the (shape, dtype) list,
decision the route or the committed choice (None: not decided yet). Every exchange sends
(key, note); the note (why) is shown, never compared.
"""

from __future__ import annotations

import contextlib
import os

import torch

from infini_dist.scheduler.settings import AUTO
from infini_dist.scheduler.control import (ControlPlane, ControlPlaneError, RankMismatchError,
                                           control_plane)

UNDECIDED = "no decision yet"


def wanted(mode, device: torch.device) -> bool:
    """Whether calls with tensors on `device` are agreed under `mode` (True, False, "auto")."""
    if mode != AUTO:
        return mode
    return (device.type == "cpu"
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


def inputs_of(values) -> list:
    """The comparable form of a call's inputs: [shape, dtype] per tensor, repr otherwise."""
    return [[list(v.shape), str(v.dtype)] if isinstance(v, torch.Tensor) else repr(v)
            for v in values]


def _shown(inputs) -> str:
    # Shapes read as torch prints them, (5, 16), so a message names them the way users write them.
    if not isinstance(inputs, list):
        return str(inputs)
    return "[" + ", ".join(f"{tuple(v[0])} {v[1].removeprefix('torch.')}" if isinstance(v, list)
                           else str(v) for v in inputs) + "]"


def _as_entry(item) -> tuple:
    # A peer in another kind of exchange (its flag differs) sent something else: show it.
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple) \
            and len(item[0]) == 3:
        return item
    return ((f"another exchange: {str(item)[:120]}", None, None), "")


def agree_key(plane: ControlPlane, key: tuple, note: str, step: str, noun: str) -> None:
    """Raise RankMismatchError on every rank of the plane unless all hold an equal key."""
    with plane.lock:  # one exchange at a time with tunings on this plane (they hold it too)
        gathered = [_as_entry(item) for item in plane.all_gather((key, note), step)]
    if all(other == key for other, _ in gathered):
        return
    first = gathered[0][0]
    what = ("graphs" if any(k[0] != first[0] for k, _ in gathered) else
            "input shapes or dtypes" if any(k[1] != first[1] for k, _ in gathered) else noun)
    odd = [plane.ranks[i] for i, (k, _) in enumerate(gathered) if k != first]
    detail = "; ".join(f"rank {plane.ranks[i]}: inputs {_shown(k[1])} -> {k[2] or UNDECIDED}"
                       + (f" ({why})" if why else "") for i, (k, why) in enumerate(gathered))
    raise RankMismatchError(f"infini_dist: ranks disagree on {what} at step {step!r}. "
                            f"Ranks {odd} differ from rank {plane.ranks[0]}. {detail}")


def site_key(sub, values: dict, decided: str | None) -> tuple:
    """An engine site's call key: its subgraph, its inputs, its committed choice."""
    return (f"site {sub.signature()}", inputs_of(values.values()), decided)


def agree_site(group, timeout_s: float, key: tuple) -> None:
    agree_key(control_plane(group, timeout_s), key, "", "call",
              "decisions (a rank has none for these inputs yet: its settings or input layouts "
              "differ)")


@contextlib.contextmanager
def noting_cached_peers(agreed: bool, mode):
    """Around a rank's first exchange for a new signature: when calls are not agreed, a timeout
    there may mean peers took a cached path, so the error says so and names the flag."""
    try:
        yield
    except RankMismatchError:
        raise
    except ControlPlaneError as error:
        if agreed:
            raise
        raise ControlPlaneError(
            f"{error} Calls are not agreed here (agree_every_call={mode!r} for these tensors): "
            f"peers that have this call's route or decision cached went straight into their "
            f"collective and may stay blocked there until the process group's own timeout. "
            f"Set infini_dist.config.agree_every_call = True so every call is agreed before "
            f"any rank acts.") from error


def agree_cached(entry, group, timeout_s: float) -> None:
    """The exchange of a call that runs a committed choice; `entry` is the site's (key, on CUDA)
    for this signature, or None where its calls are not agreed."""
    # Not while recorded into a CUDA graph: its replays have no host step to pair with.
    if entry is not None and not (entry[1] and torch.cuda.is_current_stream_capturing()):
        agree_site(group, timeout_s, entry[0])
