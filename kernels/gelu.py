"""gelu, one pass, exact (erf) or tanh-approximated.

Unfused torch:
    out = torch.nn.functional.gelu(x.float(), approximate=approximate).to(x.dtype)
"""

import functools

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels import nt_runtime
from infini_dist.kernels.chain import GELU_APPROXIMATIONS
from infini_dist.kernels.rows import arrangement, run_elementwise, tiled_premake


def gelu_erf_fp32(x):
    return 0.5 * x * (1.0 + ntl.erf(x * 0.7071067811865476))


def gelu_tanh_fp32(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u), and Triton has sigmoid but no tanh;
    # 1.5957691216057308 is 2 * sqrt(2 / pi).
    return x * ntl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


def erf_application(input, output):
    x = ntl.cast(input, ntl.float32)
    output = gelu_erf_fp32(x)  # noqa: F841


def tanh_application(input, output):
    x = ntl.cast(input, ntl.float32)
    output = gelu_tanh_fp32(x)  # noqa: F841


def check_approximate(approximate):
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be one of {GELU_APPROXIMATIONS}, "
                         f"got {approximate!r}")


def premake(block_m, block_n, approximate="none"):
    check_approximate(approximate)
    application = tanh_application if approximate == "tanh" else erf_application
    return tiled_premake(arrangement, application, (Tensor(2), Tensor(2)), block_m, block_n)


@functools.cache
def make(block_m, block_n, num_warps, approximate="none"):
    return nt_runtime.make(premake(block_m, block_n, approximate), num_warps)


def gelu(x, approximate="none", out=None):
    check_approximate(approximate)
    make_ = functools.partial(make, approximate=approximate)
    return run_elementwise(make_, (x,), out=out)
