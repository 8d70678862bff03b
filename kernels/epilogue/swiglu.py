"""swiglu: silu(gate) * up. In the symmetric-memory chain the chain value is the gate
(swiglu_gate) or the up projection (swiglu_up)."""

import torch.nn.functional as F

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise


def swiglu(gate, up):
    return F.silu(gate) * up


def _nt_code(step, args, out):
    # Every helper call is a whole right-hand side (ninetoothed 0.26 drops nested inlines).
    return [f"{out[0]}_gate = silu_fp32({args[0]})", f"{out[0]} = {out[0]}_gate * {args[1]}"]


SPEC = elementwise(
    "swiglu", swiglu, 2,
    spellings=(Spelling("swiglu", lambda gate, up: F.silu(gate) * up, (0, 1)),),
    nt_code=_nt_code, nt_helpers=("silu_fp32",),
    symm_steps=(SymmStep("swiglu_gate", "x * sigmoid_fp32(x) * side", side="row"),
                SymmStep("swiglu_up", "side * sigmoid_fp32(side) * x", side="row")),
    symm_pick=lambda position, attrs, side: (("swiglu_gate", "swiglu_up")[position]
                                             if side == "row" else None))
