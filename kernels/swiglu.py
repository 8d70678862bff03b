"""swiglu, one pass: out = silu(gate) * up.

Unfused torch:
    out = (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
"""

import functools

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels import nt_runtime
from infini_dist.kernels.rows import arrangement, run_elementwise
from infini_dist.kernels.silu import silu_fp32


def application(gate, up, output):
    gate32 = ntl.cast(gate, ntl.float32)
    # A helper call must be a statement's whole right-hand side: ninetoothed 0.26 drops the
    # inlined body of a call nested in an expression.
    activated = silu_fp32(gate32)
    output = activated * ntl.cast(up, ntl.float32)  # noqa: F841


def premake(block_m, block_n):
    arrangement_ = functools.partial(arrangement, block_m=block_m, block_n=block_n)
    return arrangement_, application, (Tensor(2), Tensor(2), Tensor(2))


@functools.cache
def make(block_m, block_n, num_warps):
    return nt_runtime.make(premake(block_m, block_n), num_warps)


def swiglu(gate, up, out=None):
    return run_elementwise(make, (gate, up), out=out)
