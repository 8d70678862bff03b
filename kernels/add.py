"""add, one pass: out = a + b (b broadcast to a's shape; the result has torch's promoted dtype).

Unfused torch:
    out = (a.float() + b.float()).to(torch.promote_types(a.dtype, b.dtype))
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.rows import arrangement, cached_make, run_elementwise, tiled_premake


def application(input, other, output):
    output = ntl.cast(input, ntl.float32) + ntl.cast(other, ntl.float32)  # noqa: F841


def premake(block_m, block_n):
    tensors = (Tensor(2), Tensor(2), Tensor(2))
    return tiled_premake(arrangement, application, tensors, block_m, block_n)


make = cached_make(premake)


def add(a, b, out=None):
    return run_elementwise(make, (a, b), out=out)
