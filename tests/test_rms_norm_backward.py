"""kernels/rms_norm_backward against torch autograd in float64: on the CPU through Triton's
interpreter (interpreter_worker.py), and on a GPU where there is one. Also the eager op's
backward (scheduler/backward.add_rms_norm_backward) takes the kernel on CUDA and torch elsewhere.

Tolerances: the kernel keeps fp32 inside and rounds each output once, so d h is compared at a
few units in the last place of its dtype relative to the row's scale; d weight sums over rows in
fp32 (per-program partials), so it gets a small relative tolerance.
"""

from __future__ import annotations

import pytest
import torch

from infini_dist.scheduler.backward import add_rms_norm_backward
from interpreter_worker import call_kernel, run

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _inputs(shape, dtype, seed, with_residual_grad=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    w = (torch.rand(shape[-1:], generator=g) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    dres = torch.randn(shape, generator=g).to(dtype) if with_residual_grad else None
    return [t.to(device) if t is not None else None for t in (h, w, dy, dres)]


def autograd_reference(h, w, dy, dres, eps):
    """(d h, d weight) by torch autograd in float64 through the plain rms_norm formula."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    out = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * w64
    loss = (out * dy.double()).sum()
    if dres is not None:
        loss = loss + (h64 * dres.double()).sum()
    return torch.autograd.grad(loss, (h64, w64))


def assert_close(got, expected, dtype, what):
    expected = expected.to(got.device)
    scale = expected.abs().max().item() + 1e-12
    error = (got.double() - expected).abs().max().item() / scale
    assert error < TOL[dtype], f"{what}: max error {error:.3g} of the largest value"


CASES = [((7, 40), True), ((3, 5, 37), False), ((300, 8), True), ((1, 129), True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_interpreted_against_autograd(pool, dtype):
    for index, (shape, residual) in enumerate(CASES):  # (300, 8): rows > MAX_PROGRAMS
        h, w, dy, dres = _inputs(shape, dtype, seed=index, with_residual_grad=residual)
        dh, dw = run(pool, call_kernel, "rms_norm_backward", "rms_norm_backward", h, w, dy,
                     dres, 1e-5)
        assert dh.dtype == dtype and dw.dtype == dtype and dh.shape == h.shape
        ref_dh, ref_dw = autograd_reference(h, w, dy, dres, 1e-5)
        assert_close(dh, ref_dh, dtype, f"dh {shape}")
        assert_close(dw, ref_dw, dtype, f"dw {shape}")


def test_interpreted_runs_repeat_bit_for_bit(pool):
    h, w, dy, dres = _inputs((300, 24), torch.bfloat16, seed=9)
    first = run(pool, call_kernel, "rms_norm_backward", "rms_norm_backward", h, w, dy, dres, 1e-6)
    again = run(pool, call_kernel, "rms_norm_backward", "rms_norm_backward", h, w, dy, dres, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_bad_inputs_are_refused():
    from infini_dist.kernels.rms_norm_backward import rms_norm_backward, supports
    h, w, dy, dres = _inputs((4, 8), torch.float32, seed=1)
    assert supports(h, w, dy, dres)
    assert not supports(h, w[:4], dy, dres)
    assert not supports(h, w, dy.double(), dres)
    assert not supports(h.int(), w, dy, dres)
    assert not supports(torch.empty(0, 8), w, torch.empty(0, 8))
    with pytest.raises(ValueError, match="rms_norm_backward"):
        rms_norm_backward(h, w, dy[:2], dres)


def test_the_eager_op_backward_runs_torch_on_cpu():
    h, w, dy, dres = _inputs((6, 33), torch.float32, seed=4)
    dh, dw = add_rms_norm_backward(h, w, dy, dres, 1e-6)
    ref_dh, ref_dw = autograd_reference(h, w, dy, dres, 1e-6)
    assert_close(dh, ref_dh, torch.float32, "dh")
    assert_close(dw, ref_dw, torch.float32, "dw")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_gpu_against_autograd_and_the_torch_path(dtype):
    from infini_dist.kernels.rms_norm_backward import rms_norm_backward
    for index, (shape, residual) in enumerate(CASES + [((2048, 4096), True), ((5, 5120), True)]):
        h, w, dy, dres = _inputs(shape, dtype, seed=index, with_residual_grad=residual,
                                 device="cuda")
        dh, dw = rms_norm_backward(h, w, dy, dres, 1e-5)
        ref_dh, ref_dw = autograd_reference(h, w, dy, dres, 1e-5)
        assert_close(dh, ref_dh, dtype, f"dh {shape}")
        assert_close(dw, ref_dw, dtype, f"dw {shape}")
        via_op = add_rms_norm_backward(h, w, dy, dres if dres is not None else
                                       torch.zeros_like(h), 1e-5)
        assert_close(via_op[0], ref_dh, dtype, f"eager op dh {shape}")
        again = rms_norm_backward(h, w, dy, dres, 1e-5)
        assert torch.equal(again[0], dh) and torch.equal(again[1], dw)  # fixed grid: same bits
