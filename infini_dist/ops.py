"""Eager deferred-choice ops: all_reduce fused with what follows it.

Each call runs a small graph through the engine. The first call per token bucket tunes across
the group (every rank of `group` must make the call, as with any collective); later calls go
straight to the committed choice.
"""

from __future__ import annotations

import functools

import torch

import infini_dist
from infini_dist.scheduler import cpp_launch
from infini_dist.scheduler.engine import executor_for
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.store import STORE


@functools.cache
def relu_scale_graph(scale: float) -> SubGraph:
    return SubGraph((OpNode("all_reduce", ("x",), ("reduced",)),
                     OpNode("relu", ("reduced",), ("activated",)),
                     OpNode("scale", ("activated",), ("output",), {"scale": scale})),
                    ("x",), ("output",))


@functools.cache
def add_rms_norm_graph(eps: float) -> SubGraph:
    return SubGraph((OpNode("all_reduce", ("x",), ("reduced",)),
                     OpNode("add_rms_norm", ("reduced", "residual", "weight"),
                            ("output", "residual_out"), {"eps": eps})),
                    ("x", "residual", "weight"), ("output", "residual_out"))


@functools.cache
def swiglu_graph() -> SubGraph:
    # Two partial sums reduced side by side: with 'cross_subgraph' they become one collective.
    return SubGraph((OpNode("all_reduce", ("gate",), ("gate_sum",)),
                     OpNode("all_reduce", ("up",), ("up_sum",)),
                     OpNode("swiglu", ("gate_sum", "up_sum"), ("output",))),
                    ("gate", "up"), ("output",))


# Each op's key into the engine's C++ table (scheduler/cpp_launch.py): `.call` makes a committed
# launch for exactly a call's inputs from C++, once the table is built and the launch recorded.
OP_NAMES = ("all_reduce_relu_scale", "all_reduce_add_rms_norm", "all_reduce_swiglu")
_RELU_SCALE, _ADD_RMS_NORM, _SWIGLU = (STORE.entry(name) for name in OP_NAMES)
cpp_launch.start_early(infini_dist.config.snapshot())


def _run(name: str, graph: SubGraph, inputs: dict, group, scalar: float = 0.0) -> dict:
    for value_name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: {value_name} must be a tensor, got {type(value).__name__}")
    executor = executor_for(graph, infini_dist.config.snapshot())
    return executor.run(inputs, group, STORE.entries[name], scalar)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def _autograd():
    from infini_dist import ops_autograd  # it builds on this module
    return ops_autograd


def all_reduce_relu_scale(x: torch.Tensor, scale: float, group=None) -> torch.Tensor:
    """relu(all_reduce(x)) * scale."""
    call = _RELU_SCALE.call  # C++: a committed launch for exactly these inputs, else None
    if call is not None and type(scale) is float:
        out = call(_RELU_SCALE.op, group, scale, [x])
        if out is not None:
            return out[0]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"all_reduce_relu_scale: scale must be a number, got {scale!r}")
    if _wants_grad(x):
        return _autograd().all_reduce_relu_scale(x, float(scale), group)
    return _run("all_reduce_relu_scale", relu_scale_graph(float(scale)), {"x": x}, group,
                float(scale))["output"]


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float = 1e-6, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = all_reduce(x) + residual; returns (rms_norm(h) * weight, h)."""
    call = _ADD_RMS_NORM.call
    if call is not None and type(eps) is float:
        out = call(_ADD_RMS_NORM.op, group, eps, [x, residual, weight])
        if out is not None:
            return out
    if x.shape != residual.shape:
        raise ValueError(f"all_reduce_add_rms_norm: x {tuple(x.shape)} and residual "
                         f"{tuple(residual.shape)} differ in shape")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"all_reduce_add_rms_norm: weight must have shape {tuple(x.shape[-1:])}, "
                         f"got {tuple(weight.shape)}")
    if _wants_grad(x, residual, weight):
        return _autograd().all_reduce_add_rms_norm(x, residual, weight, float(eps), group)
    out = _run("all_reduce_add_rms_norm", add_rms_norm_graph(float(eps)),
               {"x": x, "residual": residual, "weight": weight}, group, float(eps))
    return out["output"], out["residual_out"]


def all_reduce_swiglu(gate: torch.Tensor, up: torch.Tensor, group=None) -> torch.Tensor:
    """silu(all_reduce(gate)) * all_reduce(up)."""
    call = _SWIGLU.call
    if call is not None:
        out = call(_SWIGLU.op, group, 0.0, [gate, up])
        if out is not None:
            return out[0]
    if gate.shape != up.shape:
        raise ValueError(f"all_reduce_swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} "
                         f"differ in shape")
    if _wants_grad(gate, up):
        return _autograd().all_reduce_swiglu(gate, up, group)
    return _run("all_reduce_swiglu", swiglu_graph(), {"gate": gate, "up": up}, group)["output"]


def decisions() -> list[dict]:
    """What each op used so far decided, for reports: op, candidates, times, committed choice."""
    rows = []
    for name in OP_NAMES:
        executor = STORE.entries[name].executor
        for runner in executor.site_runners() if executor is not None else ():
            if runner.last_decision is not None:
                rows.append(dict(runner.last_decision, op=name))
    return rows
