"""relu, one pass: out = max(x, 0).

Unfused torch:
    out = torch.relu(x.float()).to(x.dtype)
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.rows import arrangement, cached_make, run_elementwise, tiled_premake


def relu_fp32(x):
    # ntl.maximum, not max(): the interpreter does not translate Python's max.
    return ntl.maximum(x, 0.0)


def application(input, output):
    x = ntl.cast(input, ntl.float32)
    output = relu_fp32(x)  # noqa: F841


def premake(block_m, block_n):
    return tiled_premake(arrangement, application, (Tensor(2), Tensor(2)), block_m, block_n)


make = cached_make(premake)


def relu(x, out=None):
    return run_elementwise(make, (x,), out=out)
