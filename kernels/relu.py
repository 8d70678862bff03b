"""relu, one pass: out = max(x, 0).

Unfused torch:
    out = torch.relu(x.float()).to(x.dtype)
"""

import functools

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels import nt_runtime
from infini_dist.kernels.rows import arrangement, run_elementwise


def relu_fp32(x):
    # ntl.maximum, not max(): the interpreter does not translate Python's max.
    return ntl.maximum(x, 0.0)


def application(input, output):
    x = ntl.cast(input, ntl.float32)
    output = relu_fp32(x)  # noqa: F841


def premake(block_m, block_n):
    arrangement_ = functools.partial(arrangement, block_m=block_m, block_n=block_n)
    return arrangement_, application, (Tensor(2), Tensor(2))


@functools.cache
def make(block_m, block_n, num_warps):
    return nt_runtime.make(premake(block_m, block_n), num_warps)


def relu(x, out=None):
    return run_elementwise(make, (x,), out=out)
