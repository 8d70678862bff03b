"""swiglu, one pass: out = silu(gate) * up.

Unfused torch:
    out = torch.nn.functional.silu(gate.float()) * up.float()
    out = out.to(torch.promote_types(gate.dtype, up.dtype))
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.rows import arrangement, cached_make, run_elementwise, tiled_premake
from infini_dist.kernels.silu import silu_fp32


def application(gate, up, output):
    gate32 = ntl.cast(gate, ntl.float32)
    # A helper call must be a statement's whole right-hand side: ninetoothed 0.26 drops the
    # inlined body of a call nested in an expression.
    activated = silu_fp32(gate32)
    output = activated * ntl.cast(up, ntl.float32)  # noqa: F841


def premake(block_m, block_n):
    tensors = (Tensor(2), Tensor(2), Tensor(2))
    return tiled_premake(arrangement, application, tensors, block_m, block_n)


make = cached_make(premake)


def swiglu(gate, up, out=None):
    return run_elementwise(make, (gate, up), out=out)
