"""relu: max(x, 0)."""

import torch

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise


def relu(x):
    return torch.relu(x)


SPEC = elementwise(
    "relu", relu, 1,
    spellings=(Spelling("relu", lambda x: torch.relu(x)),),
    nt_code=lambda step, args, out: [f"{out[0]} = relu_fp32({args[0]})"],
    nt_helpers=("relu_fp32",),
    symm_steps=(SymmStep("relu", "tl.maximum(x, 0.0)"),))
