"""Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, rounded once (the
weight is stored as an offset from 1; transformers' GemmaRMSNorm / Gemma2RMSNorm)."""

import torch

from infini_dist.kernels.epilogue.rms_norm import rms_slot
from infini_dist.kernels.epilogue.spec import (EPS, OpSpec, Spelling, check_norm_input,
                                               compute_dtype)


def gemma_rms_norm(x, weight, eps: float = 1e-6):
    check_norm_input("gemma_rms_norm", x)
    h = x.to(compute_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(h.dtype))).to(x.dtype)


def _transformers(x, weight):
    # transformers' Gemma2RMSNorm.forward, as written there
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * (1.0 + weight.float())).type_as(x)


def _nt_code(step, args, out):
    o = out[0]
    return [f"{o}_in = ntl.where(in_row, {args[0]}, 0.0)", f"{o}_w = 1.0 + {args[1]}",
            f"{o} = rms_normalize_fp32({o}_in, {o}_w, {step.attr('eps')}, num_cols)"]


SPEC = OpSpec(
    "gemma_rms_norm", "rowwise", 2, gemma_rms_norm, attrs=(("eps", 1e-6),), vectors=(1,),
    spellings=(Spelling("gemma_rms_norm", _transformers, captures=(("eps", EPS),)),),
    nt_code=_nt_code, nt_helpers=("rms_normalize_fp32",),
    symm_norm=rms_slot("y * (1.0 + weight)", ("value", "weight")))
