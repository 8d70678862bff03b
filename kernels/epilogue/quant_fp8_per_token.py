"""quant_fp8_per_token: dynamic per-token FP8 e4m3 quantization, as vLLM's
dynamic_per_token_scaled_fp8_quant: per row, scale = max(|row|) / 448 in fp32, floored at
1 / (448 * 512) so that an all-zero row gives zeros rather than NaN; then
(row / scale).clamp(-448, 448) rounded once to float8_e4m3fn. Returns (the fp8 tensor, the fp32
scales of shape rows x 1).

The scale needs the whole row, so it is a "rowwise" op; in the symmetric-memory kernels it
quantizes the norm's output, whose row one program holds. In the ninetoothed chain it makes the
chain rowwise (whole rows per tile), and the scales are a per-row result (rows x 1, fp32)."""

import torch

from infini_dist.kernels.epilogue.quant_fp8 import FP8, FP8_MAX, SYMM_CLAMP
from infini_dist.kernels.epilogue.spec import OpSpec, Spelling, SymmQuant

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's min_scaling_factor for e4m3


def quant_fp8_per_token(x):
    if not x.dtype.is_floating_point:
        raise TypeError(f"quant_fp8_per_token needs a floating-point input, got {x.dtype}")
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    scales = (h.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (h / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales.float()


def _divided(x):
    # scales first, then a division: what vLLM's CUDA kernel computes
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def _vllm_native(x):
    # vLLM's QuantFP8.forward_native: max over the row, then a multiply by the reciprocal
    x_max, _ = x.abs().max(dim=-1)
    scales = (x_max.unsqueeze(-1).to(torch.float32) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.to(torch.float32) * scales.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def _nt_code(step, args, out):
    # Lanes past the row end hold whatever earlier steps made of zeros (sigmoid: 0.5): the
    # row's max must skip them.
    q, s = out
    return [f"{s}_abs = ntl.where(in_row, ntl.abs({args[0]}), 0.0)",
            f"{s} = ntl.maximum(ntl.max({s}_abs, axis=1, keep_dims=True) / {FP8_MAX}, "
            f"{MIN_SCALE!r})",
            f"{q} = ntl.minimum(ntl.maximum({args[0]} / {s}, -{FP8_MAX}), {FP8_MAX})"]


SPEC = OpSpec(
    "quant_fp8_per_token", "rowwise", 1, quant_fp8_per_token, native=_vllm_native,
    num_outputs=2, out_dtype=FP8, per_row_outputs=(1,),
    spellings=(Spelling("quant_fp8_per_token", _divided),
               Spelling("quant_fp8_per_token_vllm", _vllm_native)),
    nt_code=_nt_code,
    # y is zero past the row end, so the max over the padded row is the row's
    symm_quant=SymmQuant(
        f"row_scale = tl.maximum(tl.max(tl.abs(y), axis=-1, keep_dims=True) / {FP8_MAX}, "
        f"{MIN_SCALE!r})\n" + SYMM_CLAMP.format(v="y / row_scale"), row_scale=True))
