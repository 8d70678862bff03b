"""gelu, exact (erf) or tanh-approximated."""

import torch.nn.functional as F

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise

APPROXIMATIONS = ("none", "tanh")


def gelu(x, approximate: str = "none"):
    return F.gelu(x, approximate=approximate)


def _nt_code(step, args, out):
    helper = "gelu_tanh_fp32" if step.attr("approximate") == "tanh" else "gelu_erf_fp32"
    return [f"{out[0]} = {helper}({args[0]})"]


SPEC = elementwise(
    "gelu", gelu, 1, attrs=(("approximate", "none"),),
    choices=(("approximate", APPROXIMATIONS),),
    spellings=(Spelling("gelu", lambda x: F.gelu(x), attrs=(("approximate", "none"),)),
               Spelling("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"),
                        attrs=(("approximate", "tanh"),))),
    nt_code=_nt_code, nt_helpers=("gelu_erf_fp32", "gelu_tanh_fp32"),
    symm_steps=(
        SymmStep("gelu", "0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))"),
        # tanh(u) = 2 sigmoid(2u) - 1, with u = sqrt(2 / pi) * (x + 0.044715 x^3)
        SymmStep("gelu_tanh", "0.5 * x * (1.0 + (2.0 * sigmoid_fp32(1.5957691216057308 * "
                              "(x + 0.044715 * x * x * x)) - 1.0))")),
    symm_pick=lambda position, attrs, side: {"none": "gelu", "tanh": "gelu_tanh"}.get(
        attrs.get("approximate", "none")))
