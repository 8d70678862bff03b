"""The local ops' backward for the eager ops' autograd (infini_dist/ops_autograd.py): the engine
picks the kernel or torch by device and support, as it picks forward choices, so the user surface
never calls a kernel itself."""

from __future__ import annotations

import torch


def add_rms_norm_backward_torch(h, weight, grad_out, grad_h, eps: float):
    """(d h, d weight) of out = rms_norm(h) * weight, plus grad_h flowing into h, in torch ops
    with fp32 inside: the unfused equivalent of kernels/rms_norm_backward."""
    h32, dy = h.float(), grad_out.float()
    rstd = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = h32 * rstd
    dyw = dy * weight.float()
    dh = rstd * (dyw - xhat * (dyw * xhat).mean(-1, keepdim=True)) + grad_h.float()
    dw = (dy * xhat).reshape(-1, h.shape[-1]).sum(0)
    return dh.to(h.dtype), dw.to(weight.dtype)


def add_rms_norm_backward(h, weight, grad_out, grad_h, eps: float):
    """The same gradients; on CUDA by one fused kernel, which reads each input once where the
    torch ops make a dozen passes with fp32 intermediates."""
    if h.is_cuda:
        from infini_dist.kernels import rms_norm_backward as kernel
        if kernel.supports(h, weight, grad_out, grad_h):
            return kernel.rms_norm_backward(h, weight, grad_out, grad_h, eps)
    return add_rms_norm_backward_torch(h, weight, grad_out, grad_h, eps)
