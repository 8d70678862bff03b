"""mul: a * b (torch's promoted dtype)."""

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise


def mul(a, b):
    return a * b


SPEC = elementwise(
    "mul", mul, 2,
    spellings=(Spelling("mul", lambda a, b: a * b, (0, 1), commutative=True),),
    nt_code=lambda step, args, out: [f"{out[0]} = {args[0]} * {args[1]}"],
    symm_steps=(SymmStep("mul", "x * side", side="row"),))
