"""rms_rstd: the fp32 rsqrt(mean(x^2) + eps) per row that an RMSNorm's backward reuses. The
compile pass exposes it from a matched rms_norm (training); no chain kernel computes it."""

import torch

from infini_dist.kernels.epilogue.spec import OpSpec


def rms_rstd(x, eps: float = 1e-6):
    return torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)


SPEC = OpSpec("rms_rstd", "rowwise", 1, rms_rstd, attrs=(("eps", 1e-6),))
