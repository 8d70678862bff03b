"""Every op's reference against torch in float64, user ops, and a user op as a tuned site."""

import pytest
import torch
import torch.nn.functional as F

from infini_dist.scheduler import op_registry
from multirank import run_ranks


def sample(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


X, Y, W = sample(6, 33, seed=1), sample(6, 33, seed=2), sample(33, seed=3).abs() + 0.5


def rms64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


CASES = {
    "add": ((X, Y), {}, lambda: X.double() + Y.double()),
    "mul": ((X, Y), {}, lambda: X.double() * Y.double()),
    "scale": ((X,), {"scale": -1.5}, lambda: X.double() * -1.5),
    "relu": ((X,), {}, lambda: torch.relu(X.double())),
    "silu": ((X,), {}, lambda: F.silu(X.double())),
    "gelu": ((X,), {}, lambda: F.gelu(X.double())),
    "sigmoid": ((X,), {}, lambda: torch.sigmoid(X.double())),
    "swiglu": ((X, Y), {}, lambda: F.silu(X.double()) * Y.double()),
    "rms_norm": ((X, W), {"eps": 1e-5}, lambda: rms64(X, W, 1e-5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_reference_matches_torch(name, dtype, tol):
    tensors, attrs, expected = CASES[name]
    (out,) = op_registry.run_node(name, [t.to(dtype) for t in tensors], attrs)
    assert out.dtype == dtype and out.shape == tensors[0].shape
    torch.testing.assert_close(out.double(), expected(), rtol=tol, atol=tol)


def test_gelu_tanh_and_add_rms_norm():
    (tanh,) = op_registry.run_node("gelu", [X], {"approximate": "tanh"})
    torch.testing.assert_close(tanh.double(), F.gelu(X.double(), approximate="tanh"))
    assert not torch.allclose(tanh, op_registry.run_node("gelu", [X], {})[0], atol=1e-6)
    normed, total = op_registry.run_node("add_rms_norm", [X.bfloat16(), Y.bfloat16(), W.float()],
                                 {"eps": 1e-6})
    assert normed.dtype == torch.bfloat16 and total.dtype == torch.bfloat16
    exact = X.bfloat16().double() + Y.bfloat16().double()
    torch.testing.assert_close(total.double(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(normed.double(), rms64(exact, W, 1e-6), rtol=2e-2, atol=2e-2)


def test_register_op_rules():
    def triple(x):
        return x * 3

    spec = op_registry.register_op("test_triple", triple, kind="elementwise", num_inputs=1,
                                   replace=True)
    assert op_registry.get_op("test_triple") is spec
    assert op_registry.may_fuse("test_triple", "epilogue")
    assert op_registry.register_op("test_triple", triple, kind="elementwise", num_inputs=1) is spec
    before = op_registry.generation()
    assert op_registry.register_op("test_triple", triple, kind="elementwise", num_inputs=1) is spec
    assert op_registry.generation() == before  # the same definition again changes nothing
    identity = op_registry.register_op("test_triple", lambda x: x, kind="elementwise")
    assert op_registry.get_op("test_triple") is identity and op_registry.generation() == before + 1
    with pytest.raises(ValueError, match="built-in"):
        op_registry.register_op("add", triple, kind="elementwise")
    with pytest.raises(ValueError, match="kind"):
        op_registry.register_op("test_bad_kind", triple, kind="sideways")
    with pytest.raises(TypeError, match="callable"):
        op_registry.register_op("test_not_callable", 3)
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        op_registry.get_op("nope")
    assert not op_registry.may_fuse("all_reduce", "epilogue")
    assert op_registry.may_fuse("rms_norm", "epilogue")
    assert not op_registry.may_fuse("rms_norm", "prologue")
    assert op_registry.may_fuse("relu", "prologue")
    assert op_registry.may_fuse("quant_fp8", "epilogue")
    assert not op_registry.may_fuse("quant_fp8", "prologue")  # no backend sums fp8


def matmul_site(rank, world_size):
    """A user op with two implementations, its epilogue fused, tuned across the ranks."""
    import infini_dist
    from infini_dist.scheduler.engine import executor_for
    from infini_dist.scheduler.ir import OpNode, SubGraph

    def by_einsum(a, b):
        return torch.einsum("ik,kj->ij", a, b)

    op_registry.register_op("test_matmul", torch.matmul, num_inputs=2,
                    implementations={"mm": torch.mm, "einsum": by_einsum})
    graph = SubGraph((OpNode("test_matmul", ("a", "b"), ("c",)),
                      OpNode("relu", ("c",), ("d",)),
                      OpNode("scale", ("d",), ("out",), {"scale": 2.0})), ("a", "b"), ("out",))
    a, b = sample(16, 32, seed=5), sample(32, 8, seed=6)
    with infini_dist.config.patch(benchmark_warmup=1, benchmark_reps=3):
        executor = executor_for(graph, infini_dist.config.snapshot())
        out = executor.run({"a": a, "b": b})["out"]
    record = executor.site_runners()[0].last_tuning
    torch.testing.assert_close(out.double(), torch.relu(a.double() @ b.double()) * 2.0,
                               rtol=1e-5, atol=1e-5)
    return record["choice"], sorted(record["candidates"])


def test_user_op_implementations_are_tuned_and_agreed():
    (c0, cands0), (c1, cands1) = run_ranks(matmul_site, 2)
    assert c0 == c1
    assert cands0 == cands1 == sorted(["native"] + [f"impl:{i}[p0,e{e}]" for i in ("mm", "einsum")
                                                     for e in range(3)])
