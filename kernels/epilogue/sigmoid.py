"""sigmoid: 1 / (1 + exp(-x))."""

import torch

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise


def sigmoid(x):
    return torch.sigmoid(x)


SPEC = elementwise(
    "sigmoid", sigmoid, 1,
    spellings=(Spelling("sigmoid", lambda x: torch.sigmoid(x)),),
    nt_code=lambda step, args, out: [f"{out[0]} = sigmoid_fp32({args[0]})"],
    nt_helpers=("sigmoid_fp32",),
    symm_steps=(SymmStep("sigmoid", "sigmoid_fp32(x)"),))
