"""layer_norm over the last dim with weight and bias: (x - mean) * rsqrt(var + eps) * weight +
bias (biased variance), in fp32, rounded once (GPT-NeoX, Phi-2: nn.LayerNorm); and
layer_norm_no_bias, the same without the bias (nn.LayerNorm(bias=False), Cohere's Command-R
LayerNorm): two specs of one module, so their spellings share one matcher."""

import torch
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


def layer_norm_no_bias(x, weight, eps: float = 1e-5):
    check_norm_input("layer_norm_no_bias", x)
    h = x.to(compute_dtype(x))
    return F.layer_norm(h, x.shape[-1:], weight.to(h.dtype), None, eps).to(x.dtype)


def native_layer_norm_no_bias(x, weight, eps: float = 1e-5):
    check_norm_input("layer_norm_no_bias", x)
    return F.layer_norm(x, x.shape[-1:], *same_dtype(x, weight), None, eps)


def _cohere(x, w):
    # transformers' CohereLayerNorm.forward, as written there
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + EPS)
    return (w.to(torch.float32) * h).to(x.dtype)


def _nt_code(step, args, out):
    o, eps = out[0], step.attr("eps")
    bias = f" + {args[2]}" if len(args) > 2 else ""
    return [f"{o}_in = ntl.where(in_row, {args[0]}, 0.0)",
            f"{o}_mean = ntl.sum({o}_in, axis=1, keep_dims=True) / num_cols",
            f"{o}_c = ntl.where(in_row, {o}_in - {o}_mean, 0.0)",
            f"{o}_var = ntl.sum({o}_c * {o}_c, axis=1, keep_dims=True) / num_cols",
            f"{o} = {o}_c * ntl.rsqrt({o}_var + {eps}) * {args[1]}{bias}"]


def _symm_code(bias: str) -> str:
    return f"""\
mean = tl.sum(y, axis=-1, keep_dims=True) / ROW_LEN
centered = tl.where(mask, y - mean, 0.0)
variance = tl.sum(centered * centered, axis=-1, keep_dims=True) / ROW_LEN
y = centered * tl.math.rsqrt(variance + eps) * weight{bias}"""


SPECS = (
    OpSpec("layer_norm", "rowwise", 3, layer_norm, native=native_layer_norm,
           attrs=(("eps", 1e-5),), vectors=(1, 2),
           spellings=(Spelling("layer_norm",
                               lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS),
                               captures=(("eps", EPS),)),),
           nt_code=_nt_code,
           symm_norm=SymmNorm(_symm_code(" + bias"), ("value", "weight", "bias"))),
    OpSpec("layer_norm_no_bias", "rowwise", 2, layer_norm_no_bias,
           native=native_layer_norm_no_bias, attrs=(("eps", 1e-5),), vectors=(1,),
           spellings=(Spelling("layer_norm_no_bias",
                               lambda x, w: F.layer_norm(x, (x.shape[-1],), w, None, EPS),
                               captures=(("eps", EPS),)),
                      Spelling("layer_norm_cohere", _cohere, captures=(("eps", EPS),))),
           nt_code=_nt_code, symm_norm=SymmNorm(_symm_code(""), ("value", "weight"))),
)
