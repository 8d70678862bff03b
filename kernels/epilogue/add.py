"""add: a + b (torch's promoted dtype). In the symmetric-memory chain the other operand is a
tensor of the chain's shape, or a bias: a 1-D vector over the last dim (a row-parallel linear's
bias, added after its all_reduce)."""

from infini_dist.kernels.epilogue.spec import Spelling, SymmStep, elementwise


def add(a, b):
    return a + b


SPEC = elementwise(
    "add", add, 2,
    spellings=(Spelling("add", lambda a, b: a + b, (0, 1), commutative=True),),
    nt_code=lambda step, args, out: [f"{out[0]} = {args[0]} + {args[1]}"],
    symm_steps=(SymmStep("add", "x + side", side="row"),
                SymmStep("bias_add", "x + side", side="vector")),
    symm_pick=lambda position, attrs, side: {"row": "add", "vector": "bias_add"}.get(side))
