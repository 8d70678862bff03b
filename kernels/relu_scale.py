"""relu then scale, one pass: out = max(x, 0) * s for a Python scalar s.

Unfused torch:
    y = torch.relu(x)
    out = (y.float() * s).to(x.dtype)
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.relu import relu_fp32
from infini_dist.kernels.rows import arrangement, cached_make, run_elementwise, tiled_premake


def application(input, scale, output):
    x = ntl.cast(input, ntl.float32)
    # A helper call must be a statement's whole right-hand side: ninetoothed 0.26 drops the
    # inlined body of a call nested in an expression.
    activated = relu_fp32(x)
    output = activated * scale  # noqa: F841


def premake(block_m, block_n):
    tensors = (Tensor(2), Tensor(0), Tensor(2))
    return tiled_premake(arrangement, application, tensors, block_m, block_n)


make = cached_make(premake)


def relu_scale(x, s, out=None):
    return run_elementwise(make, (x,), (float(s),), out=out)
