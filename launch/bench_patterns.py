"""The cases of `infini-dist bench` (launch/bench.py): per pattern, the site's graph, what a user
writes after the all_reduce in eager torch, the inputs, and the outputs in comparable units."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infini_dist.kernels.epilogue.quant_fp8_per_token import quant_fp8_per_token
from infini_dist.scheduler.ir import OpNode, SubGraph

EPS = 1e-6
SCALE = 0.5
FP8_SCALE = 0.05  # a static per-tensor scale: normed values of a few units use e4m3's range
PATTERNS = ("add_rms_norm", "add_rms_norm_fp8", "add_rms_norm_fp8_tensor", "add_rms_norm_fp8_token",
            "relu_scale", "swiglu")
# The FP8 patterns whose output is the quantized value over a static scale: a float, or a
# one-element fp32 tensor the kernel reads at run time (how FP8 checkpoints hold it).
STATIC_FP8 = ("add_rms_norm_fp8", "add_rms_norm_fp8_tensor")


def pattern_graph(pattern: str) -> SubGraph:
    ar = OpNode("all_reduce", ("x",), ("y",))
    if pattern == "add_rms_norm":
        return SubGraph((ar, OpNode("add_rms_norm", ("y", "residual", "weight"), ("out", "h"),
                                    {"eps": EPS})), ("x", "residual", "weight"), ("out", "h"))
    if pattern == "add_rms_norm_fp8":  # FP8 inference: the normed value quantized, static scale
        return SubGraph((ar, OpNode("add_rms_norm", ("y", "residual", "weight"), ("n", "h"),
                                    {"eps": EPS}),
                         OpNode("quant_fp8", ("n",), ("out",), {"scale": FP8_SCALE})),
                        ("x", "residual", "weight"), ("out", "h"))
    if pattern == "add_rms_norm_fp8_tensor":  # the scale a checkpoint's buffer
        return SubGraph((ar, OpNode("add_rms_norm", ("y", "residual", "weight"), ("n", "h"),
                                    {"eps": EPS}),
                         OpNode("quant_fp8_tensor_scale", ("n", "qscale"), ("out",))),
                        ("x", "residual", "weight", "qscale"), ("out", "h"))
    if pattern == "add_rms_norm_fp8_token":  # the same, with a dynamic per-token scale
        return SubGraph((ar, OpNode("add_rms_norm", ("y", "residual", "weight"), ("n", "h"),
                                    {"eps": EPS}),
                         OpNode("quant_fp8_per_token", ("n",), ("out", "scales"))),
                        ("x", "residual", "weight"), ("out", "scales", "h"))
    if pattern == "relu_scale":
        return SubGraph((ar, OpNode("relu", ("y",), ("a",)),
                         OpNode("scale", ("a",), ("out",), {"scale": SCALE})), ("x",), ("out",))
    if pattern == "swiglu":
        return SubGraph((ar, OpNode("swiglu", ("y", "up"), ("out",))), ("x", "up"), ("out",))
    raise ValueError(f"unknown pattern {pattern!r}")


def eager_epilogue(pattern: str, y, inputs):
    """What a user writes after the all_reduce, in eager torch."""
    if pattern.startswith("add_rms_norm"):
        h = y + inputs["residual"]
        out = F.rms_norm(h, (h.shape[-1],), inputs["weight"], EPS)
        if pattern in STATIC_FP8:
            out = (out / inputs.get("qscale", FP8_SCALE)).clamp(-448.0, 448.0).to(
                torch.float8_e4m3fn)
        if pattern == "add_rms_norm_fp8_token":  # vLLM's dynamic per-token quant
            return (*quant_fp8_per_token(out), h)
        return out, h
    if pattern == "relu_scale":
        return torch.relu(y) * SCALE
    return F.silu(y) * inputs["up"]


def make_inputs(pattern, tokens, hidden, dtype, device, rank):
    g = torch.Generator().manual_seed(1234 + rank)
    shared = torch.Generator().manual_seed(99)  # side tensors are replicated, as under TP
    values = {"x": torch.randn(tokens, hidden, generator=g)}
    graph = pattern_graph(pattern)
    for name in graph.input_names[1:]:
        size = (hidden,) if name == "weight" else (tokens, hidden)
        values[name] = torch.randn(size, generator=shared) + (1.0 if name == "weight" else 0.0)
    values = {n: v.to(device=device, dtype=dtype) for n, v in values.items()}
    if "qscale" in values:  # a checkpoint's scale: one fp32 element
        values["qscale"] = torch.tensor([FP8_SCALE], dtype=torch.float32, device=device)
    return values


def dequantized(pattern, outputs):
    """The outputs with the first in the input's units (an fp8 output times its scale)."""
    if pattern in STATIC_FP8:
        return (outputs[0].float() * FP8_SCALE,) + tuple(outputs[1:])
    if pattern == "add_rms_norm_fp8_token":
        return (outputs[0].float() * outputs[1],) + tuple(outputs[1:])
    return outputs
