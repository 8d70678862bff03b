"""Gradients of the eager fused ops (TP convention: the all_reduce's backward is the identity)
against torch autograd of the unfused ops in float64, on 2 ranks, under every kind of choice."""

import pytest
import torch
import torch.nn.functional as F

from multirank import run_ranks

SHAPE = (6, 32)
EPS = 1e-5
SCALE = 0.75


def _partial(rank, salt):
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(salt * 100 + rank))


def _replicated(shape, salt):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(10_000 + salt))


def _inputs(rank, dtype, device, rounded_to=None):
    """The op's inputs; `rounded_to`: values of that dtype, held in `dtype`."""
    def leaf(t):
        t = t.to(rounded_to) if rounded_to is not None else t
        return t.to(device=device, dtype=dtype).requires_grad_()
    return {"x": leaf(_partial(rank, 1)), "residual": leaf(_replicated(SHAPE, 2)),
            "weight": leaf(_replicated(SHAPE[-1:], 3).abs() + 0.5),
            "gate": leaf(_partial(rank, 4)), "up": leaf(_partial(rank, 5)),
            "g_out": leaf(_replicated(SHAPE, 6)).detach(),
            "g_h": leaf(_replicated(SHAPE, 7)).detach()}


def _loss(t, out, h=None):
    loss = (out * t["g_out"]).sum()
    return loss if h is None else loss + (h * t["g_h"]).sum()


def fused_grads(rank, world, dtype_name, flags, device_type="cpu"):
    import infini_dist
    from infini_dist import ops
    dtype = getattr(torch, dtype_name)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    t = _inputs(rank, dtype, device)
    grads = {}
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2, **flags):
        for _ in range(2):  # tuning call, then the committed choice
            for v in t.values():
                v.grad = None
            out, h = ops.all_reduce_add_rms_norm(t["x"], t["residual"], t["weight"], eps=EPS)
            _loss(t, out, h).backward()
            grads["norm"] = [t[k].grad.cpu() for k in ("x", "residual", "weight")]
            y = ops.all_reduce_relu_scale(t["x"], SCALE)
            t["x"].grad = None
            _loss(t, y).backward()
            grads["relu_scale"] = [t["x"].grad.cpu()]
            y = ops.all_reduce_swiglu(t["gate"], t["up"])
            _loss(t, y).backward()
            grads["swiglu"] = [t[k].grad.cpu() for k in ("gate", "up")]
        with torch.no_grad():  # no autograd history, the inference graph
            grads["no_grad_has_fn"] = ops.all_reduce_relu_scale(t["x"], SCALE).grad_fn is not None
    return grads


def reference_grads(rank, world, dtype):
    """Each rank's gradients, float64 torch autograd of the unfused ops on the full sums of the
    same (rounded) inputs."""
    t = _inputs(rank, torch.float64, torch.device("cpu"), dtype)

    def total(name, salt):
        others = sum(_partial(r, salt).to(dtype).double() for r in range(world) if r != rank)
        return t[name] + others

    grads = {}
    h = total("x", 1) + t["residual"]
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * t["weight"]
    grads["norm"] = torch.autograd.grad(_loss(t, out, h), [t["x"], t["residual"], t["weight"]])
    y = torch.relu(total("x", 1)) * SCALE
    grads["relu_scale"] = torch.autograd.grad(_loss(t, y), [t["x"]])
    y = F.silu(total("gate", 4)) * total("up", 5)
    grads["swiglu"] = torch.autograd.grad(_loss(t, y), [t["gate"], t["up"]])
    return grads


def check(results, world, tol):
    for rank, result in enumerate(results):
        expected = reference_grads(rank, world, results[0]["norm"][0].dtype)
        assert result["no_grad_has_fn"] is False
        for name, ref in expected.items():
            for index, (got, want) in enumerate(zip(result[name], ref)):
                assert got.dtype == results[0][name][index].dtype
                torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol,
                                           msg=f"{name} grad {index} on rank {rank}")
    for name in ("norm", "relu_scale", "swiglu"):  # replicated grads agree bitwise
        assert all(torch.equal(a, b) for a, b in zip(results[0][name][1:], results[1][name][1:]))


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("flags", [{}, {"enable_custom_op_fusion": False}], ids=["fused", "off"])
def test_eager_op_gradients_match_torch_autograd(dtype, tol, flags):
    check(run_ranks(fused_grads, 2, dtype, flags, timeout=180), 2, tol)


@pytest.mark.multigpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_eager_op_gradients_match_torch_autograd_on_gpus(dtype, tol):
    check(run_ranks(fused_grads, 2, dtype, {}, "cuda", backend="nccl", timeout=300), 2, tol)
