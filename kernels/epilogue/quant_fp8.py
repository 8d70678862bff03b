"""quant_fp8: static per-tensor FP8 e4m3 quantization, (x / scale).clamp(-448, 448) in fp32,
rounded once to float8_e4m3fn (vLLM's static_scaled_fp8_quant; `scale` is a Python number).
Its output dtype is not its input's; it ends a chain (the value is stored, not read again): in
the symmetric-memory kernels it is their output quantization, after the chain or the norm."""

import torch

from infini_dist.kernels.epilogue.spec import SCALE, OpSpec, Spelling, SymmQuant

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The clamp every FP8 quantizer's symmetric-memory code ends with ({v} is the divided value).
SYMM_CLAMP = f"q = tl.minimum(tl.maximum({{v}}, -{FP8_MAX}), {FP8_MAX})"


def quant_fp8(x, scale: float = 1.0):
    if not x.dtype.is_floating_point:
        raise TypeError(f"quant_fp8 needs a floating-point input, got {x.dtype}")
    return (x.to(torch.promote_types(x.dtype, torch.float32)) / scale).clamp(-FP8_MAX,
                                                                             FP8_MAX).to(FP8)


def native_quant_fp8(x, scale: float = 1.0):
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _spelling(upcast: bool, bound):
    def quantize(x):
        return ((x.float() if upcast else x) / SCALE).clamp(-bound, bound).to(FP8)
    return Spelling(f"quant_fp8{'_fp32' if upcast else ''}{'_int' if type(bound) is int else ''}",
                    quantize, captures=(("scale", SCALE),))


SPEC = OpSpec(
    "quant_fp8", "elementwise", 1, quant_fp8, native=native_quant_fp8, attrs=(("scale", 1.0),),
    out_dtype=FP8,
    # with or without an upcast first; bounds as floats (finfo) or as ints (a graph keeps 448)
    spellings=tuple(_spelling(upcast, bound) for upcast in (False, True) for bound in (448, 448.0)),
    nt_code=lambda step, args, out: [
        f"{out[0]} = ntl.minimum(ntl.maximum({args[0]} / {step.attr('scale')}, -{FP8_MAX}), "
        f"{FP8_MAX})"],
    symm_quant=SymmQuant(SYMM_CLAMP.format(v="y / scale"), scalar="scale"))
