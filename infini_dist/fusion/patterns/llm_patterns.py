"""SubGraphs for the small ops of a transformer layer, ready for FusionScheduler.dispatch.

Combined ops or primitives: where the registry has a combined op (`swiglu`, `add_rms_norm`) the
patterns use it rather than its primitives (silu then mul; add then rms_norm), because
- it is one rounding to the output dtype instead of two: the sum that feeds the norm stays in fp32,
  which is what a fused kernel does, so the unfused baseline and the fused choices agree closely;
- it is one epilogue node instead of two, so tuning has fewer depths (choices) to time;
- it is the form model code already calls (vLLM's fused_add_rms_norm, silu_and_mul).
The engine fuses either form as an epilogue; only these trade-offs differ.

Value names: inputs and outputs are the ones listed per function; intermediates are private.
"""

from __future__ import annotations

import math
import numbers

from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.op_registry import attr_choices


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _eps(value) -> float:
    eps = _real("eps", value)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {value!r}")
    return eps


def create_swiglu_pattern() -> SubGraph:
    """gate, up -> output = silu(gate) * up (the gated MLP activation)."""
    return SubGraph((OpNode("swiglu", ("gate", "up"), ("output",)),), ("gate", "up"), ("output",))


def create_add_rms_norm_pattern(eps: float = 1e-6) -> SubGraph:
    """x, residual, weight -> residual_out = x + residual,
    output = rms_norm(residual_out) * weight (over the last dim)."""
    return SubGraph((OpNode("add_rms_norm", ("x", "residual", "weight"),
                            ("output", "residual_out"), {"eps": _eps(eps)}),),
                    ("x", "residual", "weight"), ("output", "residual_out"))


def create_gelu_pattern(approximate: str = "none") -> SubGraph:
    """x -> output = gelu(x), exact ("none") or the tanh approximation ("tanh")."""
    approximations = attr_choices("gelu", "approximate")
    if approximate not in approximations:
        raise ValueError(f"approximate must be one of {approximations}, got {approximate!r}")
    return SubGraph((OpNode("gelu", ("x",), ("output",), {"approximate": approximate}),),
                    ("x",), ("output",))


def create_all_reduce_relu_scale_pattern(scale: float = 1.0) -> SubGraph:
    """x -> output = relu(all_reduce_sum(x)) * scale. Collective: dispatch on every rank."""
    return SubGraph((OpNode("all_reduce", ("x",), ("x_reduced",)),
                     OpNode("relu", ("x_reduced",), ("x_relu",)),
                     OpNode("scale", ("x_relu",), ("output",), {"scale": _real("scale", scale)})),
                    ("x",), ("output",))


def create_all_reduce_add_rms_norm_pattern(eps: float = 1e-6) -> SubGraph:
    """x, residual, weight -> residual_out = all_reduce_sum(x) + residual,
    output = rms_norm(residual_out) * weight: the tensor-parallel layer tail. Collective."""
    return SubGraph((OpNode("all_reduce", ("x",), ("x_reduced",)),
                     OpNode("add_rms_norm", ("x_reduced", "residual", "weight"),
                            ("output", "residual_out"), {"eps": _eps(eps)})),
                    ("x", "residual", "weight"), ("output", "residual_out"))
