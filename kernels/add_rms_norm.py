"""Residual add then rms_norm, one pass; the norm reads the fp32 sum, not its rounded copy.

Unfused torch:
    total = x.float() + residual.float()
    normed = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float())
    return normed.to(x.dtype), total.to(x.dtype)
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.rms_norm import rms_normalize_fp32
from infini_dist.kernels.rows import (arrangement, broadcast_shape, cached_make, check_dtypes,
                                     output, run_rowwise, tiled_premake)


def application(input, residual, weight, eps, num_cols, output, residual_out):
    total = ntl.cast(input, ntl.float32) + ntl.cast(residual, ntl.float32)
    residual_out = total  # noqa: F841
    w = ntl.cast(weight, ntl.float32)
    output = rms_normalize_fp32(total, w, eps, num_cols)  # noqa: F841


def premake(block_m, block_n):
    tensors = (Tensor(2, other=0.0), Tensor(2, other=0.0), Tensor(1, other=0.0), Tensor(0),
               Tensor(0), Tensor(2), Tensor(2))
    return tiled_premake(arrangement, application, tensors, block_m, block_n)


make = cached_make(premake)


def add_rms_norm(x, residual, weight, eps=1e-6, out=None, residual_out=None):
    """Returns (normed, x + residual), both of x's shape and dtype."""
    check_dtypes(x, residual)
    shape = broadcast_shape((x.shape, residual.shape))
    if tuple(shape) != tuple(x.shape):
        raise ValueError(f"residual of shape {tuple(residual.shape)} would change x's shape "
                         f"{tuple(x.shape)}")
    out = output(out, shape, x.dtype, x.device)
    residual_out = output(residual_out, shape, x.dtype, x.device, "residual_out")
    run_rowwise(make, (x, residual), weight, (float(eps),), (out, residual_out))
    return out, residual_out
