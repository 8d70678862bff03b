"""quant_fp8_per_token: dynamic per-token FP8 e4m3 quantization, as vLLM's
dynamic_per_token_scaled_fp8_quant: per row, scale = max(|row|) / 448 in fp32, floored at
`min_scale` (vLLM's 1 / (448 * 512), so that an all-zero row gives zeros rather than NaN); then
(row / scale).clamp(-448, 448) rounded once to float8_e4m3fn. Returns (the fp8 tensor, the fp32
scales of shape rows x 1). `quant_fp8_per_token_reciprocal` is the same with the row multiplied
by the scale's fp32 reciprocal instead (vLLM's forward_native, many users' code): that rounds
differently, so it is an op of its own and each spelling keeps its own numerics.

One matcher for both (`_spellings`): the scale computed in fp32 from the row (upcast first, or
the row's max upcast), floored as vLLM does ((max / 448).clamp(min=m)) or before the division
(max.clamp(min=eps) / 448, the same as a floor of fl32(eps / 448) on the scale: division by 448
is monotonic); 448 as an int or as finfo's float, clamp(min=), clamp_min and torch.clamp all
match alike. A scale computed in bf16 or fp16 is not this op (its scales are not fp32).

The scale needs the whole row, so it is a "rowwise" op; in the symmetric-memory kernels it
quantizes the norm's output, whose row one program holds. In the ninetoothed chain it makes the
chain rowwise (whole rows per tile), and the scales are a per-row result (rows x 1, fp32)."""

import math

import torch

from infini_dist.kernels.epilogue.quant_fp8 import FP8, FP8_MAX, SYMM_CLAMP
from infini_dist.kernels.epilogue.spec import SCALE, OpSpec, Spelling, SymmQuant

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's min_scaling_factor for e4m3


def _scaled(h, scales, reciprocal: bool):
    return h * scales.reciprocal() if reciprocal else h / scales


def _reference(reciprocal: bool):
    def quantize(x, min_scale: float = MIN_SCALE):
        name = "quant_fp8_per_token" + ("_reciprocal" if reciprocal else "")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} needs a floating-point input, got {x.dtype}")
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        scales = (h.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=min_scale)
        return _scaled(h, scales, reciprocal).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales.float()
    return quantize


quant_fp8_per_token = _reference(reciprocal=False)


def _native(reciprocal: bool):
    def quantize(x, min_scale: float = MIN_SCALE):
        # scales first, then a division (vLLM's CUDA kernel) or a reciprocal's product
        scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=min_scale)
        return _scaled(x.float(), scales, reciprocal).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales
    return quantize


def _vllm_native(x):
    # vLLM's QuantFP8.forward_native: max over the row, then a multiply by the reciprocal
    x_max, _ = x.abs().max(dim=-1)
    scales = (x_max.unsqueeze(-1).to(torch.float32) / FP8_MAX).clamp(min=SCALE)
    return (x.to(torch.float32) * scales.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def _floor(captured: dict) -> dict | None:
    """A positive floor only: with none, an all-zero row is 0 / 0, whose NaN the kernels'
    clamp would not keep as torch's does."""
    floor = captured["min_scale"]
    return {"min_scale": floor} if 0 < floor < math.inf else None


def _floor_before_division(captured: dict) -> dict | None:
    """max.clamp(min=eps) / 448 == (max / 448).clamp(min=fl32(fl32(eps) / 448)) exactly: fp32
    division by 448 is monotonic, so it commutes with max()."""
    eps = torch.tensor(captured["min_scale"], dtype=torch.float32)
    return _floor({"min_scale": float(eps / FP8_MAX)})


def _spelling(reciprocal: bool, upcast: str, floor_first: bool):
    """upcast: "first" (the row in fp32 throughout), "max" (the row's max upcast, the row
    upcast for the division) or "mixed" (the max upcast, the row divided as it is: torch
    promotes it to fp32)."""
    def quantize(x):
        h = x.float() if upcast == "first" else x
        row_max = h.abs().amax(dim=-1, keepdim=True).float()
        scales = (row_max.clamp(min=SCALE) / FP8_MAX if floor_first
                  else (row_max / FP8_MAX).clamp(min=SCALE))
        row = x if upcast == "mixed" else h.float()
        return _scaled(row, scales, reciprocal).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales
    name = (f"quant_fp8_per_token{'_reciprocal' if reciprocal else ''}_{upcast}"
            f"{'_floor_first' if floor_first else ''}")
    return Spelling(name, quantize, captures=(("min_scale", SCALE),),
                    attrs_of=_floor_before_division if floor_first else _floor)


def _spellings(reciprocal: bool) -> tuple:
    if reciprocal:
        found = [_spelling(True, upcast, False) for upcast in ("first", "max")]
        return (*found, Spelling("quant_fp8_per_token_vllm", _vllm_native,
                                 captures=(("min_scale", SCALE),), attrs_of=_floor))
    return tuple(_spelling(False, upcast, floor_first)
                 for upcast in ("first", "max", "mixed") for floor_first in (False, True))


def _nt_code(reciprocal: bool):
    def code(step, args, out):
        # Lanes past the row end hold whatever earlier steps made of zeros (sigmoid: 0.5): the
        # row's max must skip them.
        q, s = out
        scaled = f"{args[0]} * (1.0 / {s})" if reciprocal else f"{args[0]} / {s}"
        return [f"{s}_abs = ntl.where(in_row, ntl.abs({args[0]}), 0.0)",
                f"{s} = ntl.maximum(ntl.max({s}_abs, axis=1, keep_dims=True) / {FP8_MAX}, "
                f"{step.attr('min_scale')})",
                f"{q} = ntl.minimum(ntl.maximum({scaled}, -{FP8_MAX}), {FP8_MAX})"]
    return code


def _spec(reciprocal: bool) -> OpSpec:
    scaled = "y * (1.0 / row_scale)" if reciprocal else "y / row_scale"
    return OpSpec(
        "quant_fp8_per_token" + ("_reciprocal" if reciprocal else ""), "rowwise", 1,
        _reference(reciprocal), native=_native(reciprocal), attrs=(("min_scale", MIN_SCALE),),
        num_outputs=2, out_dtype=FP8, per_row_outputs=(1,), spellings=_spellings(reciprocal),
        nt_code=_nt_code(reciprocal),
        # `row_max`: max |y| over the row (y is zero past its end); `scale` is min_scale
        symm_quant=SymmQuant(
            f"row_scale = tl.maximum(row_max / {FP8_MAX}, scale)\n" + SYMM_CLAMP.format(v=scaled),
            scalar="min_scale", row_scale=True))


SPECS = (_spec(reciprocal=False), _spec(reciprocal=True))
