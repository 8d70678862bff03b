"""silu: x * sigmoid(x)."""

import torch.nn.functional as F

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise


def silu(x):
    return F.silu(x)


SPEC = elementwise(
    "silu", silu, 1,
    spellings=(Spelling("silu", lambda x: F.silu(x)),),
    nt_code=lambda step, args, out: [f"{out[0]} = silu_fp32({args[0]})"],
    nt_helpers=("silu_fp32",),
    symm_steps=(SymmStep("silu", "x * sigmoid_fp32(x)"),))
