"""add, one pass: out = a + b (b broadcast to a's shape; the result has a's dtype).

Unfused torch:
    out = (a.float() + b.float()).to(a.dtype)
"""

import functools

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels import nt_runtime
from infini_dist.kernels.rows import arrangement, run_elementwise


def application(input, other, output):
    output = ntl.cast(input, ntl.float32) + ntl.cast(other, ntl.float32)  # noqa: F841


def premake(block_m, block_n):
    arrangement_ = functools.partial(arrangement, block_m=block_m, block_n=block_n)
    return arrangement_, application, (Tensor(2), Tensor(2), Tensor(2))


@functools.cache
def make(block_m, block_n, num_warps):
    return nt_runtime.make(premake(block_m, block_n), num_warps)


def add(a, b, out=None):
    return run_elementwise(make, (a, b), out=out)
