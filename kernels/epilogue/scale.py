"""scale: x * s for a Python number s (an attribute)."""

from infini_dist.kernels.epilogue.spec import SCALE, Spelling, SymmStep, elementwise


def scale(x, scale: float = 1.0):
    return x * scale


SPEC = elementwise(
    "scale", scale, 1, attrs=(("scale", 1.0),),
    spellings=(Spelling("scale", lambda x: x * SCALE, captures=(("scale", SCALE),)),),
    nt_code=lambda step, args, out: [f"{out[0]} = {args[0]} * {step.attr('scale')}"],
    symm_steps=(SymmStep("scale", "x * scalar", scalar="scale"),))
