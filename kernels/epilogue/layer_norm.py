"""layer_norm over the last dim with weight and bias: (x - mean) * rsqrt(var + eps) * weight +
bias (biased variance), in fp32, rounded once (GPT-NeoX, Phi-2: nn.LayerNorm)."""

import torch.nn.functional as F

from infini_dist.kernels.epilogue.spec import (EPS, OpSpec, Spelling, SymmNorm,
                                               check_norm_input, compute_dtype, same_dtype)


def layer_norm(x, weight, bias, eps: float = 1e-5):
    check_norm_input("layer_norm", x)
    h = x.to(compute_dtype(x))
    return F.layer_norm(h, x.shape[-1:], weight.to(h.dtype), bias.to(h.dtype), eps).to(x.dtype)


def native_layer_norm(x, weight, bias, eps: float = 1e-5):
    check_norm_input("layer_norm", x)
    return F.layer_norm(x, x.shape[-1:], *same_dtype(x, weight, bias), eps)


def _nt_code(step, args, out):
    o, eps = out[0], step.attr("eps")
    return [f"{o}_in = ntl.where(in_row, {args[0]}, 0.0)",
            f"{o}_mean = ntl.sum({o}_in, axis=1, keep_dims=True) / num_cols",
            f"{o}_c = ntl.where(in_row, {o}_in - {o}_mean, 0.0)",
            f"{o}_var = ntl.sum({o}_c * {o}_c, axis=1, keep_dims=True) / num_cols",
            f"{o} = {o}_c * ntl.rsqrt({o}_var + {eps}) * {args[1]} + {args[2]}"]


SYMM_CODE = """\
mean = tl.sum(y, axis=-1, keep_dims=True) / ROW_LEN
centered = tl.where(mask, y - mean, 0.0)
variance = tl.sum(centered * centered, axis=-1, keep_dims=True) / ROW_LEN
y = centered * tl.math.rsqrt(variance + eps) * weight + bias"""

SPEC = OpSpec(
    "layer_norm", "rowwise", 3, layer_norm, native=native_layer_norm, attrs=(("eps", 1e-5),),
    vectors=(1, 2),
    spellings=(Spelling("layer_norm",
                        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS),
                        captures=(("eps", EPS),)),),
    nt_code=_nt_code, symm_norm=SymmNorm(SYMM_CODE, ("value", "weight", "bias")))
