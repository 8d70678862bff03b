"""The backward of rms_norm (and of add + rms_norm), one pass over the rows: d h, the residual's
gradient folded in, and per-program partial sums of d weight.

Unfused torch: infini_dist.scheduler.backward.add_rms_norm_backward_torch, in fp32 with one
rounding per output, computing per row
    rstd = 1 / sqrt(mean(h^2) + eps),  xhat = h * rstd
    dh = rstd * (dy * w - xhat * mean(dy * w * xhat)) + grad_h,   dw = sum over rows of dy * xhat

That is a dozen kernels with fp32 intermediates of h's size; this kernel reads h, grad_out and
grad_h once and writes dh once. Each program walks rows pid, pid + G, ... and keeps its share of
d weight in registers; a second kernel sums the G partial rows (fp32, in order). G depends on
the row count alone, so every rank (and every run) adds in the same order: the same bits
everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infini_dist.kernels.rows import FLOAT_DTYPES, INT32_LIMIT

MAX_PROGRAMS = 256  # enough rows in flight to fill a Hopper; few partial rows to sum after
MAX_ROW = 1 << 15  # a row lives in one program's registers
COLUMN_BLOCK = 32  # columns per program of the partials' sum: 128 programs at hidden 4096


@triton.jit
def rms_norm_backward_kernel(h_ptr, weight_ptr, dy_ptr, dres_ptr, dh_ptr, partial_ptr, rows,
                             eps, ROW: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_DRES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, rows, programs):
        offsets = row * ROW + cols  # int32: supports() keeps the tensor under 2**31 elements
        h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / ROW + eps)
        xhat = h * rstd
        dyw = dy * w
        dh = rstd * (dyw - xhat * (tl.sum(dyw * xhat, axis=0) / ROW))
        if HAS_DRES:
            dh += tl.load(dres_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offsets, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(partial_ptr + pid * ROW + cols, dw.to(partial_ptr.dtype.element_ty), mask=mask)


@triton.jit
def column_sum_kernel(partial_ptr, out_ptr, parts, ROW: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_G: tl.constexpr):
    # torch's sum over dim 0 of the partials ran at a tenth of the memory bandwidth
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < ROW
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, parts, BLOCK_G):
        part = start + tl.arange(0, BLOCK_G)
        total += tl.sum(tl.load(partial_ptr + part[:, None] * ROW + cols[None, :],
                                mask=(part[:, None] < parts) & in_row[None, :], other=0.0),
                        axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=in_row)


def rms_norm_backward_launch(h, weight, grad_out, grad_h, eps, dh, partial):
    """(kernel, grid, args, kwargs) for contiguous tensors; `partial` is [G, row]: fp32 partial
    sums, or with G = 1 d weight itself."""
    row = h.shape[-1]
    block = triton.next_power_of_2(row)
    args = (h, weight, grad_out, grad_h if grad_h is not None else grad_out, dh, partial,
            h.numel() // row, float(eps))
    kwargs = dict(ROW=row, BLOCK=block, HAS_DRES=grad_h is not None,
                  num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return rms_norm_backward_kernel, (partial.shape[0],), args, kwargs


def supports(h, weight, grad_out, grad_h=None) -> bool:
    """Whether the kernel takes these tensors (the caller runs torch otherwise)."""
    tensors = [t for t in (h, weight, grad_out, grad_h) if t is not None]
    return (h.dim() >= 1 and 0 < h.shape[-1] <= MAX_ROW and 0 < h.numel() < INT32_LIMIT
            and all(t.dtype in FLOAT_DTYPES and t.device == h.device for t in tensors)
            and weight.shape == h.shape[-1:] and grad_out.shape == h.shape
            and grad_out.dtype == h.dtype
            and (grad_h is None or (grad_h.shape == h.shape and grad_h.dtype == h.dtype)))


def rms_norm_backward(h, weight, grad_out, grad_h=None, eps: float = 1e-6):
    """(d h, d weight) of out = rms_norm(h, eps) * weight, with `grad_h` (the gradient that
    reaches h by another path, e.g. the residual stream) added to d h. Same dtypes as h and
    weight; the unfused equivalent is in this module's docstring."""
    if not supports(h, weight, grad_out, grad_h):
        raise ValueError("rms_norm_backward: h, grad_out (and grad_h) must be float tensors of "
                         f"one shape and dtype, weight of shape h.shape[-1:], rows of at most "
                         f"{MAX_ROW}")
    h, grad_out = h.contiguous(), grad_out.contiguous()
    grad_h = grad_h.contiguous() if grad_h is not None else None
    row = h.shape[-1]
    parts = min(h.numel() // row, MAX_PROGRAMS)
    dh = torch.empty_like(h)
    dw = torch.empty(row, dtype=weight.dtype, device=h.device)
    # One program: its share is all of d weight, stored directly.
    partial = dw.view(1, row) if parts == 1 else torch.empty(parts, row, dtype=torch.float32,
                                                             device=h.device)
    kernel, grid, args, kwargs = rms_norm_backward_launch(h, weight.contiguous(), grad_out,
                                                          grad_h, eps, dh, partial)
    kernel[grid](*args, **kwargs)
    if parts > 1:
        column_sum_kernel[(triton.cdiv(row, COLUMN_BLOCK),)](partial, dw, parts, ROW=row,
                                                              BLOCK_N=COLUMN_BLOCK, BLOCK_G=64)
    return dh, dw
