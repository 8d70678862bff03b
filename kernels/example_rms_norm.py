"""An example ninetoothed kernel, in the shape ntops gives its kernels; production runs rms_norm as
a step of the chain kernel (kernels/elementwise_chain.py), and this file is here to read and to
copy from. RMSNorm over the last dim, one pass: whole rows per tile, sums in fp32, rounded once.

- `application`: the math on one tile, in fp32 locals, calling a shared device helper
  (kernels/nt_device.py; ninetoothed inlines it).
- `premake`: the shared arrangement (kernels/rows.py: 2-D row views in (block_m, block_n) tiles,
  the 1-D weight repeated for every row of tiles) bound to one tile shape, with the application
  and the tensors' ranks.
- `make`: `ninetoothed.make` once per tile shape (nt_runtime adds the CPU interpreter's fixes).
- `rms_norm`: the thin torch wrapper: checks, output, tile shape from the shapes alone, launch.

Unfused torch:
    x32 = x.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
"""

import ninetoothed.language as ntl
from ninetoothed import Tensor

from infini_dist.kernels.nt_device import rms_normalize_fp32
from infini_dist.kernels.rows import (arrangement, cached_make, check_dtypes, output, run_rowwise,
                                      tiled_premake)


def application(input, weight, eps, num_cols, output):
    x = ntl.cast(input, ntl.float32)
    w = ntl.cast(weight, ntl.float32)
    output = rms_normalize_fp32(x, w, eps, num_cols)  # noqa: F841


def premake(block_m, block_n):
    # other=0: lanes past the row end must add nothing to the sum of squares.
    tensors = (Tensor(2, other=0.0), Tensor(1, other=0.0), Tensor(0), Tensor(0), Tensor(2))
    return tiled_premake(arrangement, application, tensors, block_m, block_n)


make = cached_make(premake)


def rms_norm(x, weight, eps=1e-6, out=None):
    check_dtypes(x)
    out = output(out, x.shape, x.dtype, x.device)
    run_rowwise(make, (x,), weight, (float(eps),), (out,))
    return out
