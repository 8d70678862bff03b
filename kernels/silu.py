"""silu, one pass: out = x * sigmoid(x).

Unfused torch:
    out = torch.nn.functional.silu(x.float()).to(x.dtype)
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.rows import arrangement, cached_make, run_elementwise, tiled_premake


def silu_fp32(x):
    return x * ntl.sigmoid(x)


def application(input, output):
    # Load into a local: ninetoothed inlines helpers by substituting arguments, so an argument
    # that is itself a load would be loaded once per use.
    x = ntl.cast(input, ntl.float32)
    output = silu_fp32(x)  # noqa: F841


def premake(block_m, block_n):
    return tiled_premake(arrangement, application, (Tensor(2), Tensor(2)), block_m, block_n)


make = cached_make(premake)


def silu(x, out=None):
    return run_elementwise(make, (x,), out=out)
