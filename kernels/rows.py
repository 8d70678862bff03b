"""What our ninetoothed kernels share: tensors seen as rows, one arrangement, tile shapes, launch.

Every kernel works on 2-D views: leading dims are flattened and the last dim is the row, so one
kernel (per tile shape) serves any leading shape and any strides. Elementwise kernels tile the view
in (block_m, block_n) tiles; when every tensor is contiguous they see the whole tensor as one long
row instead, so no tile is wasted on short rows. Row-wise kernels (norms) take whole rows per tile
(block_n >= row length) and block_m rows per program.

Tile shapes depend on the shapes alone, never on timing, so every rank launches the same grid and
reduces in the same order (bitwise identical results on all ranks).
"""

from __future__ import annotations

import functools

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW_BLOCK = 1 << 16  # a row-wise tile holds the whole row; longer rows are refused
TILE_ELEMENTS = 2048  # per program: 8 per thread at 8 warps, a 16-byte access for 16-bit dtypes
INT32_LIMIT = 1 << 31  # ninetoothed computes offsets in int32


def arrangement(*tensors, block_m, block_n, per_row=()):
    """2-D tensors -> (block_m, block_n) tiles. 1-D tensors are row vectors (a norm's weight):
    their block_n tile is repeated for every row of tiles. 0-D tensors (scalars) pass through.
    The 2-D tensors at the positions in `per_row` hold one value per row (rows, 1): (block_m, 1)
    tiles, the same rows as the others' tiles (row-wise kernels, whose tile holds whole rows)."""
    tiled = [t.tile((block_m, 1 if i in per_row else block_n)) if t.ndim == 2 else t
             for i, t in enumerate(tensors)]
    tile_rows = next(t.shape[0] for t in tiled if t.ndim == 2)
    return tuple(t.tile((block_n,)).unsqueeze(0).expand((tile_rows, -1)) if t.ndim == 1 else t
                 for t in tiled)


def tiled_premake(arrangement, application, tensors, block_m: int, block_n: int, **options):
    """What `ninetoothed.make` takes: `arrangement` bound to a (block_m, block_n) tile (and to
    `options`, its other keyword arguments)."""
    return (functools.partial(arrangement, block_m=block_m, block_n=block_n, **options),
            application, tensors)


def cached_make(premake):
    """`make(block_m, block_n, num_warps)`: the kernel built from `premake`, once per tile shape."""
    @functools.cache
    def make(block_m, block_n, num_warps):
        from infini_dist.kernels import nt_runtime  # it imports ninetoothed; rows must not
        return nt_runtime.make(premake(block_m, block_n), num_warps)
    return make


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_warps(block_m: int, block_n: int) -> int:
    return max(1, min(16, block_m * block_n // 256))


def check_float_dtypes(dtypes) -> None:
    for dtype in dtypes:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"infini_dist kernels take float16, bfloat16 or float32 tensors, "
                            f"got {dtype}")


def check_dtypes(*tensors: torch.Tensor) -> None:
    check_float_dtypes(t.dtype for t in tensors)


def _check_extent(view: torch.Tensor) -> None:
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(view.shape, view.stride()))
    if view.numel() and extent >= INT32_LIMIT:
        raise ValueError(f"tensor spans {extent} elements; these kernels index with int32 "
                         f"(limit {INT32_LIMIT - 1})")


def as_rows(t: torch.Tensor, shape: torch.Size, written: bool = False) -> torch.Tensor:
    """`t` broadcast to `shape`, as a (rows, last dim) view. An input that cannot be viewed so is
    copied; an output must be a view (a copy would drop what the kernel writes)."""
    cols = shape[-1] if len(shape) else 1
    if t.is_contiguous() and t.shape == shape:  # the common case, kept cheap (it runs per call)
        if t.numel() >= INT32_LIMIT:
            raise ValueError(f"{t.numel()} elements; these kernels index with int32")
        return t.view(-1, cols)
    if not written:
        view = (t if t.shape == shape else t.expand(shape)).reshape(-1, cols)
    else:
        try:
            view = t.view(-1, cols)
        except RuntimeError:
            raise ValueError(f"an output of shape {tuple(t.shape)} and strides {t.stride()} "
                             f"cannot be viewed as rows; pass a contiguous one") from None
    _check_extent(view)
    return view


def elementwise_views(inputs, outs, shape):
    """2-D views of `inputs` (broadcast to `shape`) and `outs` (of `shape`), and their tile
    shape."""
    tensors = list(inputs) + list(outs)
    numel = shape.numel()
    if all(tuple(t.shape) == tuple(shape) and t.is_contiguous() for t in tensors):
        if numel >= INT32_LIMIT:
            raise ValueError(f"{numel} elements; these kernels index with int32")
        return [t.view(1, numel) for t in tensors], 1, min(TILE_ELEMENTS, next_power_of_2(numel))
    views = ([as_rows(t, shape) for t in inputs]
             + [as_rows(t, shape, written=True) for t in outs])
    rows, cols = views[0].shape
    block_n = min(TILE_ELEMENTS // 2, next_power_of_2(cols))
    block_m = min(next_power_of_2(rows), max(1, TILE_ELEMENTS // block_n))
    return views, block_m, block_n


def row_blocks(rows: int, cols: int) -> tuple[int, int]:
    block_n = next_power_of_2(cols)
    if block_n > MAX_ROW_BLOCK:
        raise ValueError(f"rows of {cols} elements are longer than the row-wise kernels take "
                         f"({MAX_ROW_BLOCK})")
    return min(next_power_of_2(rows), max(1, TILE_ELEMENTS // block_n)), block_n


def broadcast_shape(shapes) -> torch.Size:
    # Plain Python: torch.broadcast_shapes costs more per call than a kernel launch.
    shapes = [tuple(shape) for shape in shapes]
    result = list(shapes[0])
    for shape in shapes[1:]:
        if len(shape) > len(result):
            result = [1] * (len(shape) - len(result)) + result
        offset = len(result) - len(shape)
        for i, size in enumerate(shape):
            current = result[offset + i]
            if current == 1:
                result[offset + i] = size
            elif size != 1 and size != current:
                raise ValueError(f"shapes {shapes} do not broadcast")
    return torch.Size(result)


def output(out, shape, dtype, device, what="out") -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:  # a quantizing chain's fp8 output is stored as such, nothing else
        check_dtypes(out)
    return out


def run_rowwise(make, inputs, weight, scalars, outs):
    """Launch the row-wise kernel that `make(block_m, block_n, num_warps)` builds with arguments
    (row inputs..., weight, scalars..., row length, outputs...). `outs` are already allocated."""
    check_dtypes(*inputs, weight)
    shape = outs[0].shape
    cols = shape[-1] if len(shape) else 1
    if tuple(weight.shape) != (cols,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({cols},)")
    if outs[0].numel() == 0:
        return outs
    views = ([as_rows(t, shape) for t in inputs]
             + [as_rows(t, shape, written=True) for t in outs])
    block_m, block_n = row_blocks(views[0].shape[0], cols)
    kernel = make(block_m, block_n, num_warps(block_m, block_n))
    kernel(*views[:len(inputs)], weight, *scalars, cols, *views[len(inputs):])
    return outs
