"""quant_fp8: static per-tensor FP8 e4m3 quantization, (x / scale).clamp(-448, 448) in fp32,
rounded once to float8_e4m3fn (vLLM's static_scaled_fp8_quant). Two ops, one matcher:

- `quant_fp8`: `scale` is a Python number, an attribute baked into the kernels;
- `quant_fp8_tensor_scale`: `scale` is a one-element tensor operand (an FP8 checkpoint's
  registered buffer or nn.Parameter, a graph input, a tensor made in forward), which the kernels
  read at run time: a new value between calls, or between CUDA-graph replays, is seen.

Their output dtype is not their input's; they end a chain (the value is stored, not read again):
in the symmetric-memory kernels they are the output quantization, after the chain or the norm."""

import torch

from infini_dist.kernels.epilogue.spec import SCALE, OpSpec, Spelling, SymmQuant

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The clamp every FP8 quantizer's symmetric-memory code ends with ({v} is the divided value).
SYMM_CLAMP = f"q = tl.minimum(tl.maximum({{v}}, -{FP8_MAX}), {FP8_MAX})"


def _check_input(name, x):
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} needs a floating-point input, got {x.dtype}")


def quant_fp8(x, scale: float = 1.0):
    _check_input("quant_fp8", x)
    return (x.to(torch.promote_types(x.dtype, torch.float32)) / scale).clamp(-FP8_MAX,
                                                                             FP8_MAX).to(FP8)


def native_quant_fp8(x, scale: float = 1.0):
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _check_scale(x, scale):
    """A per-tensor scale: one float element that leaves x's shape as it is (a broadcast to a
    larger shape, or another dtype category, is not this op)."""
    if (not isinstance(scale, torch.Tensor) or scale.numel() != 1
            or not scale.dtype.is_floating_point or scale.dim() > x.dim()):
        raise ValueError("quant_fp8_tensor_scale: the scale must be a one-element float tensor "
                         f"of at most x's {x.dim()} dims, got "
                         f"{getattr(scale, 'shape', scale)!r} {getattr(scale, 'dtype', '')}")


def quant_fp8_tensor_scale(x, scale):
    _check_input("quant_fp8_tensor_scale", x)
    _check_scale(x, scale)
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x.to(compute) / scale.to(compute)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def native_quant_fp8_tensor_scale(x, scale):
    _check_scale(x, scale)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _spellings(tensor_scale: bool) -> tuple:
    """Every spelling of the division by a float (the SCALE sentinel, captured) or by a tensor
    operand: with or without an upcast first. Bounds as ints (448) or floats (finfo's) match
    alike (compile/fx_patterns)."""
    def spelling(upcast):
        name = f"quant_fp8{'_tensor_scale' if tensor_scale else ''}{'_fp32' if upcast else ''}"

        def quantize(x, scale=SCALE):
            return ((x.float() if upcast else x) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if tensor_scale:
            return Spelling(name, quantize)
        return Spelling(name, lambda x: quantize(x), captures=(("scale", SCALE),))
    return tuple(spelling(upcast) for upcast in (False, True))


def _nt_code(step, args, out):
    return [f"{out[0]} = ntl.minimum(ntl.maximum({args[0]} / {step.attr('scale')}, -{FP8_MAX}), "
            f"{FP8_MAX})"]


SPECS = (
    OpSpec("quant_fp8", "elementwise", 1, quant_fp8, native=native_quant_fp8,
           attrs=(("scale", 1.0),), out_dtype=FP8, spellings=_spellings(tensor_scale=False),
           nt_code=_nt_code, symm_quant=SymmQuant(SYMM_CLAMP.format(v="y / scale"),
                                                  scalar="scale")),
    # No ninetoothed chain code (its operands are rows and weights, not a one-element tensor):
    # nccl+nt_epilogue declines it, the symmetric-memory kernels and native run it.
    OpSpec("quant_fp8_tensor_scale", "elementwise", 2, quant_fp8_tensor_scale,
           native=native_quant_fp8_tensor_scale, scalars=(1,), out_dtype=FP8,
           spellings=_spellings(tensor_scale=True),
           symm_quant=SymmQuant(SYMM_CLAMP.format(v="y / scale"), scale_operand=True)),
)
