"""The eager fused ops on 2 and 3 gloo ranks against float64 references built from every rank."""

import pytest
import torch

from multirank import run_ranks


def partial_sums(rank, shape, salt):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(salt * 100 + rank))


def replicated(shape, salt):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(10_000 + salt))


def eager_ops(rank, world_size, dtype_name):
    import infini_dist
    from infini_dist import ops
    dtype = getattr(torch, dtype_name)
    shape = (5, 24)
    results = {}
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
        x = partial_sums(rank, shape, 1).to(dtype)
        results["relu_scale"] = ops.all_reduce_relu_scale(x, 0.25)
        residual = replicated(shape, 2).to(dtype)
        weight = (replicated(shape[-1:], 3).abs() + 0.5).to(dtype)
        results["norm"], results["residual"] = ops.all_reduce_add_rms_norm(x, residual, weight,
                                                                           eps=1e-5)
        gate, up = partial_sums(rank, shape, 4).to(dtype), partial_sums(rank, shape, 5).to(dtype)
        results["swiglu"] = ops.all_reduce_swiglu(gate, up)
        results["swiglu_again"] = ops.all_reduce_swiglu(gate, up)  # committed path
        results["decisions"] = sorted((d["op"], d["choice"]) for d in ops.decisions())
    # Outside the patch the settings differ, yet the report is of the calls that were made.
    results["decisions_after"] = sorted((d["op"], d["choice"]) for d in ops.decisions())
    return results


def reference(world_size):
    shape = (5, 24)
    x = sum(partial_sums(r, shape, 1).double() for r in range(world_size))
    h = x + replicated(shape, 2).double()
    w = replicated(shape[-1:], 3).abs().double() + 0.5
    norm = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    gate = sum(partial_sums(r, shape, 4).double() for r in range(world_size))
    up = sum(partial_sums(r, shape, 5).double() for r in range(world_size))
    return {"relu_scale": torch.relu(x) * 0.25, "norm": norm, "residual": h,
            "swiglu": torch.nn.functional.silu(gate) * up}


@pytest.mark.parametrize("world_size,dtype,tol", [(2, "float32", 1e-5), (3, "float32", 1e-5),
                                                  (2, "bfloat16", 3e-2)])
def test_eager_ops_match_float64_references(world_size, dtype, tol):
    results = run_ranks(eager_ops, world_size, dtype, timeout=240)
    expected = reference(world_size)
    for name, ref in expected.items():
        for rank, result in enumerate(results):
            torch.testing.assert_close(result[name].double(), ref, rtol=tol, atol=tol,
                                       msg=f"{name} on rank {rank}")
            assert result[name].dtype == getattr(torch, dtype)
            assert torch.equal(result[name], results[0][name]), f"{name}: ranks differ"
    assert torch.equal(results[0]["swiglu"], results[0]["swiglu_again"])
    ops_decided = [op for op, _ in results[0]["decisions"]]
    assert ops_decided == ["all_reduce_add_rms_norm", "all_reduce_relu_scale",
                           "all_reduce_swiglu"]
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["decisions_after"] == results[0]["decisions"]


def test_bad_arguments_fail_before_any_collective():
    from infini_dist import ops
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="residual"):
        ops.all_reduce_add_rms_norm(x, torch.randn(3, 8), torch.randn(8))
    with pytest.raises(ValueError, match="weight"):
        ops.all_reduce_add_rms_norm(x, x, torch.randn(4))
    with pytest.raises(ValueError, match="differ in shape"):
        ops.all_reduce_swiglu(x, torch.randn(2, 4))
    with pytest.raises(TypeError, match="scale"):
        ops.all_reduce_relu_scale(x, "2")
    with pytest.raises(TypeError, match="tensor"):
        ops.all_reduce_relu_scale([1.0, 2.0], 2.0)
