"""add_rms_norm: (rms_norm(x + residual) * weight, x + residual); the norm reads the fp32 sum,
not its rounded copy. The compile pass forms it from an add followed by an rms_norm."""

from dataclasses import replace

import torch

from infini_dist.kernels.epilogue import rms_norm as rms
from infini_dist.kernels.epilogue.spec import OpSpec


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    dtype = torch.result_type(x, residual)
    if not dtype.is_floating_point:
        rms.rms(x + residual, weight, eps)  # raises torch's error
    total = x.to(torch.promote_types(dtype, torch.float32)) + residual
    return rms.rms(total, weight, eps).to(dtype), total.to(dtype)


def native_add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """What a decoder layer writes: the residual sum in the input dtype, then torch's RMSNorm."""
    total = x + residual
    return rms.native_rms_norm(total, weight, eps), total


def _nt_code(step, args, out):
    return [f"{out[1]} = {args[0]} + {args[1]}"] + rms.nt_normalize(step, [out[1]], out[0],
                                                                    args[2])


SPEC = OpSpec(
    "add_rms_norm", "rowwise", 3, add_rms_norm, native=native_add_rms_norm, num_outputs=2,
    attrs=(("eps", 1e-6),), vectors=(2,), nt_code=_nt_code, nt_helpers=rms.SPEC.nt_helpers,
    symm_norm=replace(rms.SYMM_NORM, roles=("value", "residual", "weight")))
