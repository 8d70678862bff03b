"""Autograd for the eager fused ops, in the tensor-parallel convention of DTensor and Megatron.

Forward: the all_reduce of the partial input, then the local ops, through the engine as in
inference. Backward: the gradient w.r.t. a partial input is the incoming gradient of its reduced
value (the all_reduce's backward is the identity: the reduced value is replicated, so every rank
already holds the same gradient of it), chained with the local ops' backward on the saved reduced
value. The add+RMSNorm backward is one fused kernel on CUDA (scheduler/backward.py); relu*scale and silu*mul go
through torch autograd on the op's registered reference.

The engine graphs expose what backward needs (the reduced values) as extra outputs; ops.py only
takes this path when an input requires grad under grad mode, so inference is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from infini_dist import ops
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.backward import add_rms_norm_backward
from infini_dist.scheduler.ir import SubGraph


@functools.cache
def _exposing(graph: SubGraph, extra: tuple[str, ...]) -> SubGraph:
    """`graph` with interior values it computes anyway also returned."""
    return dataclasses.replace(graph, output_names=graph.output_names + extra)


def _reference_grads(op_type: str, saved: tuple, grad_out: torch.Tensor, attrs: dict) -> tuple:
    """Gradients of the op's reference w.r.t. its inputs at `saved`."""
    leaves = [t.detach().requires_grad_() for t in saved]
    with torch.enable_grad():
        (out,) = op_registry.run_node(op_type, leaves, attrs)
        return torch.autograd.grad(out, leaves, grad_out)


class _ReluScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, group):
        out = ops._run("all_reduce_relu_scale",
                       _exposing(ops.relu_scale_graph(scale), ("reduced",)), {"x": x}, group)
        ctx.scale = scale
        ctx.save_for_backward(out["reduced"])
        return out["output"]

    @staticmethod
    def backward(ctx, grad_out):
        (reduced,) = ctx.saved_tensors
        (g,) = _reference_grads("relu", (reduced,), grad_out * ctx.scale, {})
        return g, None, None


class _AddRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, group):
        out = ops._run("all_reduce_add_rms_norm", ops.add_rms_norm_graph(eps),
                       {"x": x, "residual": residual, "weight": weight}, group)
        ctx.eps = eps
        ctx.save_for_backward(out["residual_out"], weight)
        return out["output"], out["residual_out"]

    @staticmethod
    def backward(ctx, grad_out, grad_h):
        h, weight = ctx.saved_tensors
        dh, dw = add_rms_norm_backward(h, weight, grad_out, grad_h, ctx.eps)
        return dh, dh, (dw if ctx.needs_input_grad[2] else None), None, None


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, group):
        out = ops._run("all_reduce_swiglu", _exposing(ops.swiglu_graph(), ("gate_sum", "up_sum")),
                       {"gate": gate, "up": up}, group)
        ctx.save_for_backward(out["gate_sum"], out["up_sum"])
        return out["output"]

    @staticmethod
    def backward(ctx, grad_out):
        d_gate, d_up = _reference_grads("swiglu", ctx.saved_tensors, grad_out, {})
        return d_gate, d_up, None


def all_reduce_relu_scale(x, scale: float, group):
    return _ReluScale.apply(x, scale, group)


def all_reduce_add_rms_norm(x, residual, weight, eps: float, group):
    return _AddRmsNorm.apply(x, residual, weight, eps, group)


def all_reduce_swiglu(gate, up, group):
    return _Swiglu.apply(gate, up, group)
