"""scale, one pass: out = x * s for a Python scalar s (a kernel argument: no recompile per s).

Unfused torch:
    out = (x.float() * s).to(x.dtype)
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.rows import arrangement, cached_make, run_elementwise, tiled_premake


def application(input, scale, output):
    output = ntl.cast(input, ntl.float32) * scale  # noqa: F841


def premake(block_m, block_n):
    tensors = (Tensor(2), Tensor(0), Tensor(2))
    return tiled_premake(arrangement, application, tensors, block_m, block_n)


make = cached_make(premake)


def scale(x, s, out=None):
    return run_elementwise(make, (x,), (float(s),), out=out)
