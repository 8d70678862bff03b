"""rms_norm over the last dim: x * rsqrt(mean(x^2) + eps) * weight, in fp32, rounded once."""

import torch
import torch.nn.functional as F

from infini_dist.kernels.epilogue.spec import (EPS, OpSpec, Spelling, SymmNorm,
                                               check_norm_input, compute_dtype, same_dtype)


def rms_slot(factor: str, roles: tuple[str, ...]) -> SymmNorm:
    """The norm slot of an RMSNorm whose output is (factor) * rsqrt(mean(y^2) + eps): the
    factor first, so that the output's row max is the factor's times the rsqrt (rounding is
    monotonic), which a per-row quantizer reads without a second pass over the row. Shared
    with add_rms_norm (the residual added first) and gemma_rms_norm (another weight)."""
    return SymmNorm(f"y = ({factor}) * rstd", roles,
                    "tl.math.rsqrt(squares / ROW_LEN + eps)", factor)


SYMM_NORM = rms_slot("y * weight", ("value", "weight"))


def rms(x, weight, eps):
    """rms_norm in (at least) fp32, not rounded."""
    check_norm_input("rms_norm", x)
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(x.dtype)


def rms_norm(x, weight, eps: float = 1e-6):
    return rms(x, weight, eps).to(x.dtype)


def native_rms_norm(x, weight, eps: float = 1e-6):
    """torch's own RMSNorm. Our IR keeps the input dtype, so a weight of another dtype is cast
    first (torch would otherwise leave its fused kernel)."""
    check_norm_input("rms_norm", x)
    return F.rms_norm(x, x.shape[-1:], *same_dtype(x, weight), eps)


def _llama(x, weight):
    # Llama-style: normalise in fp32, round to the input dtype, then scale by the weight.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def nt_normalize(step, args, out, weight):
    return [f"{out}_in = ntl.where(in_row, {args[0]}, 0.0)",
            f"{out} = rms_normalize_fp32({out}_in, {weight}, {step.attr('eps')}, num_cols)"]


RSTD = ("rms_rstd", torch.ops.aten.rsqrt.default)
SPEC = OpSpec(
    "rms_norm", "rowwise", 2, rms_norm, native=native_rms_norm, attrs=(("eps", 1e-6),),
    vectors=(1,),
    spellings=(
        Spelling("rms_norm_llama", _llama, captures=(("eps", EPS),), exposable=RSTD),
        Spelling("rms_norm", lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
                 captures=(("eps", EPS),), exposable=RSTD),
        Spelling("rms_norm_fp32",
                 lambda x, w: F.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS).to(x.dtype),
                 captures=(("eps", EPS),), exposable=RSTD)),
    nt_code=lambda step, args, out: nt_normalize(step, args, out[0], args[1]),
    nt_helpers=("rms_normalize_fp32",),
    symm_norm=SYMM_NORM)
