"""The ninetoothed kernels against their unfused torch equivalents, on the CPU through Triton's
interpreter (in a child process: see interpreter_worker.py): the chain kernel
(kernels/elementwise_chain.py) and the example kernel (kernels/example_rms_norm.py); plus the
chain format in-process.

Tolerances: fp32 results match to float32 rounding. For 16-bit results the interpreter rounds
fp32 -> bfloat16 by truncation where GPUs round to nearest, so one unit in the last place is
allowed; chains are compared with a reference that, like the kernel, keeps fp32 between steps,
and with the engine's own check against the step-by-step references.
"""

from __future__ import annotations

import pytest
import torch

from infini_dist.kernels.chain import Chain, Step, UnsupportedChain, chain_from_nodes
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.choices import RunContext, run_nodes
from infini_dist.scheduler.ir import OpNode, SubGraph
from interpreter_worker import call_kernel, run

CPU = RunContext(None, 1, 0, torch.device("cpu"))


def reference(op, *tensors, **attrs):
    """The op registry's reference (fp32 inside, rounded once to the first input's dtype)."""
    return op_registry.get_op(op).fn(*tensors, **attrs)
# One unit in the last place, relative; fp32 allows a few (sums in another order, numpy's exp).
ULP = {torch.float32: 2.0 ** -21, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def assert_matches(got, expected, ulps=1.0, what=""):
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape), what
    tol = ulps * ULP[expected.dtype]
    try:
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def N(op, *names, **attrs):
    """N("add", "a", "b", "c") is c = add(a, b); several outputs go in a tuple."""
    *inputs, outputs = names
    return OpNode(op, tuple(inputs), (outputs,) if isinstance(outputs, str) else tuple(outputs),
                  attrs)


def randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def layouts(dtype, seed):
    """The same kind of input in several leading shapes and memory layouts."""
    base = randn((4, 6, 38), dtype, seed)
    return {
        "1d": randn((37,), dtype, seed + 1),
        "3d": randn((2, 3, 37), dtype, seed + 2),
        "transposed": randn((37, 6), dtype, seed + 3).t(),  # last dim strided
        "sliced": base[:, ::2, 1:],  # viewable as rows, with gaps
        "permuted": base[:, :, :37].permute(1, 0, 2),  # not viewable: the wrapper copies it
    }


def test_chain_out_argument_and_errors(pool):
    # What rows.py's views do for the chain kernel: dtypes, given outputs, strides, broadcasting.
    relu = chain_from_nodes([N("relu", "x", "y")], ["x"], ["y"])
    x = randn((3, 37), torch.float32, 3)
    got = run(pool, _relu_into, relu, x, torch.full((3, 37), 7.0))
    assert_matches(got, reference("relu", x))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        run(pool, call_kernel, "elementwise_chain", "elementwise_chain", relu, torch.arange(6))
    with pytest.raises(ValueError, match="shape"):
        run(pool, call_kernel, "elementwise_chain", "elementwise_chain", relu, x,
            outs=[torch.empty(4, 37)])
    # A strided out is written through; one that cannot be seen as rows is refused.
    got = run(pool, _relu_into, relu, x.t(), torch.full((3, 37), 7.0).t())
    assert got.stride() == (1, 37)
    assert_matches(got, reference("relu", x.t()))
    permuted = randn((3, 4, 5), torch.float32, 6).permute(1, 0, 2)
    with pytest.raises(ValueError, match="viewed as rows"):
        run(pool, call_kernel, "elementwise_chain", "elementwise_chain", relu, permuted,
            outs=[torch.empty(3, 4, 5).permute(1, 0, 2)])
    add = chain_from_nodes([N("add", "x", "r", "y")], ["x", "r"], ["y"])
    with pytest.raises(ValueError, match="do not broadcast"):
        run(pool, call_kernel, "elementwise_chain", "elementwise_chain", add, x,
            randn((4, 37), torch.float32, 4))
    [empty] = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", relu,
                  torch.empty(0, 37))
    assert empty.shape == (0, 37)


def _relu_into(chain, x, out):
    from infini_dist.kernels.elementwise_chain import elementwise_chain
    [result] = elementwise_chain(chain, x, outs=[out])
    assert result is out
    return out


# Hidden sizes: small and odd, a power of two, and the non-powers of two of real models.
ROW_SHAPES = [(37,), (3, 37), (2, 3, 37), (5, 64), (2, 4100), (1, 5120)]


# ---- the example kernel ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_example_rms_norm(pool, dtype):
    for shape in ROW_SHAPES:
        x = randn(shape, dtype, shape[-1]) * 3
        weight = randn(shape[-1:], torch.float32, 1) + 1  # fp32 weight, also for bf16 inputs
        got = run(pool, call_kernel, "example_rms_norm", "rms_norm", x, weight, 1e-5)
        assert_matches(got, reference("rms_norm", x, weight, eps=1e-5), what=str(shape))
    x = randn((6, 40), dtype, 9)[::2, 2:39]  # non-contiguous rows
    weight = randn((37,), dtype, 10)
    got = run(pool, call_kernel, "example_rms_norm", "rms_norm", x, weight, 1e-6)
    assert_matches(got, reference("rms_norm", x, weight, eps=1e-6))
    with pytest.raises(ValueError, match="weight has shape"):
        run(pool, call_kernel, "example_rms_norm", "rms_norm", x, randn((36,), dtype, 1))


def test_runtime_fixes_are_installed(pool):
    patched, leftovers, generated = run(pool, _runtime_state)
    assert patched and generated and not leftovers


def _runtime_state():
    import ninetoothed.generation as generation

    from infini_dist.kernels.example_rms_norm import rms_norm
    rms_norm(torch.randn(4, 8), torch.ones(8))
    files = [p.name for p in generation.CACHE_DIR.iterdir()]
    return (getattr(generation.cache_source, "_infini_dist", False),
            [f for f in files if f.endswith(".tmp")], [f for f in files if f.endswith(".py")])


# ---- the chain kernel ---------------------------------------------------------------------------

CHAINS = {
    "relu_scale": ([N("relu", "a", "b"), N("scale", "b", "c", scale=0.25)], ["a"], ["c"]),
    "long_with_intermediate": (
        [N("add", "ar", "c", "b"), N("relu", "b", "d"), N("scale", "d", "e", scale=-0.5),
         N("gelu", "e", "f", approximate="tanh"), N("swiglu", "f", "ar", "g"),
         N("sigmoid", "g", "h"), N("mul", "h", "bias", "i")],
        ["ar", "c", "bias"], ["i", "b"]),
    "add_then_rms_norm": ([N("add", "ar", "res", "h"), N("rms_norm", "h", "w", "y", eps=1e-5)],
                          ["ar", "res", "w"], ["y", "h"]),
    "add_rms_norm": ([N("add_rms_norm", "ar", "res", "w", ("y", "h"), eps=1e-6)],
                     ["ar", "res", "w"], ["y", "h"]),
    # Gemma's (1 + w) norm, then a LayerNorm with weight and bias (the other spec'd norms)
    "gemma_then_layer_norm": ([N("add", "ar", "res", "h"), N("gemma_rms_norm", "h", "w", "g"),
                               N("layer_norm", "g", "w", "bias", "y", eps=1e-5)],
                              ["ar", "res", "w", "bias"], ["y", "g"]),
    # Zero lanes past the row end become sigmoid(0) = 0.5: the norm must not sum them.
    "sigmoid_norm_silu": ([N("sigmoid", "ar", "s"), N("rms_norm", "s", "w", "y"),
                           N("silu", "y", "z")], ["ar", "w"], ["z"]),
}


def chain_inputs(name, shape, dtype):
    cols = shape[-1]
    values = {"a": randn(shape, dtype, 1), "ar": randn(shape, dtype, 2) * 2,
              "c": randn(shape, dtype, 3), "res": randn(shape, dtype, 4),
              "bias": randn((cols,), torch.float32, 5), "w": randn((cols,), torch.float32, 6)}
    _, inputs, _ = CHAINS[name]
    return [values[n] for n in inputs]


def unfused(nodes, inputs, outputs, tensors):
    graph = SubGraph(tuple(nodes), tuple(inputs), tuple(outputs))
    env = dict(zip(inputs, tensors))
    run_nodes(graph, range(len(nodes)), env, CPU)
    return [env[n] for n in outputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chain_kernel(pool, name, dtype):
    nodes, inputs, outputs = CHAINS[name]
    chain = chain_from_nodes(nodes, inputs, outputs)
    for shape in [(2, 3, 37), (4, 64)]:
        tensors = chain_inputs(name, shape, dtype)
        got = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain, *tensors)
        stepwise = unfused(nodes, inputs, outputs, tensors)
        # The kernel's own contract: fp32 between steps, each output rounded once.
        in_fp32 = unfused(nodes, inputs, outputs, [t.float() for t in tensors])
        for g, s, f in zip(got, stepwise, in_fp32):
            assert_matches(g, f.to(s.dtype), what=f"{name} {shape}")
            assert op_registry.close_enough(g, s, computed_in=dtype), (name, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chain_kernel_layouts(pool, dtype):
    nodes = [N("swiglu", "x", "y", "s"), N("scale", "s", "out", scale=0.37)]
    chain = chain_from_nodes(nodes, ["x", "y"], ["out"])
    first, second = layouts(dtype, seed=11), layouts(dtype, seed=23)
    for layout in first:
        x, y = first[layout], second[layout]
        [got] = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain, x, y)
        assert got.is_contiguous()
        [expected] = unfused(nodes, ["x", "y"], ["out"], [x.float(), y.float()])
        assert_matches(got, expected.to(dtype), what=layout)
    # A row vector broadcast over the rows, and mixed dtypes (torch promotes: bf16 * fp32 is fp32).
    x, bias = first["3d"], randn((37,), torch.float32, 5)
    [got] = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain, x, bias)
    [expected] = unfused(nodes, ["x", "y"], ["out"], [x.float(), bias])
    assert_matches(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chain_add_rms_norm_row_shapes(pool, dtype):
    nodes, inputs, outputs = CHAINS["add_rms_norm"]
    chain = chain_from_nodes(nodes, inputs, outputs)
    for shape in ROW_SHAPES:
        x, residual = randn(shape, dtype, 1), randn(shape, dtype, 2) * 4
        weight = randn(shape[-1:], torch.float32, 3)
        normed, total = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain,
                            x, residual, weight)
        expected_normed, expected_total = reference("add_rms_norm", x, residual, weight, eps=1e-6)
        assert_matches(total, expected_total, what=str(shape))
        # The norm reads the fp32 sum, so it matches the reference that does too.
        assert_matches(normed, expected_normed, what=str(shape))
    x = randn((3, 37), dtype, 4).t().contiguous().t()  # column-major
    residual = randn((37,), dtype, 5)  # broadcast over the rows
    weight = randn((37,), dtype, 6)
    normed, total = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain, x,
                        residual, weight)
    expected_normed, expected_total = reference("add_rms_norm", x, residual, weight)
    assert_matches(total, expected_total)
    assert_matches(normed, expected_normed)


def test_chain_kernel_in_place_and_non_contiguous(pool):
    nodes, inputs, outputs = CHAINS["add_then_rms_norm"]
    chain = chain_from_nodes(nodes, inputs, outputs)
    ar, res, w = chain_inputs("add_then_rms_norm", (5, 37), torch.float32)
    res = randn((37, 5), torch.float32, 8).t()
    expected = unfused(nodes, inputs, outputs, [ar, res, w])
    got, aliased = run(pool, _chain_in_place, chain, ar, res, w)
    assert aliased
    for g, e in zip(got, expected):
        assert_matches(g, e)


def _chain_in_place(chain, ar, res, w):
    from infini_dist.kernels.elementwise_chain import elementwise_chain
    reduced = ar.clone()
    outs = elementwise_chain(chain, reduced, res, w, outs=[reduced, None])
    return outs, outs[0] is reduced


def test_generated_application_is_cached_and_readable(pool):
    nodes, inputs, outputs = CHAINS["relu_scale"]
    chain = chain_from_nodes(nodes, inputs, outputs)
    assert run(pool, _application_identity, chain)


def _application_identity(chain):
    import inspect

    from infini_dist.kernels import elementwise_chain as module
    first = module._application(chain, None)
    same = module._application(chain_from_nodes(*CHAINS["relu_scale"]), None)
    return first is same and "relu_fp32(v_0)" in inspect.getsource(first)


# ---- the chain format (no Triton) ----------------------------------------------------------------

def test_chain_from_nodes_maps_slots_and_attrs():
    nodes = [N("add", "a", "r", "b"), N("relu", "b", "c"), N("scale", "c", "d", scale=0.5)]
    chain = chain_from_nodes(nodes, ["a", "r"], ["d"])
    assert chain == Chain(("row", "row"),
                          (Step("add", (0, 1)), Step("relu", (2,)),
                           Step("scale", (3,), (("scale", "0.5"),))), (4,))
    assert not chain.rowwise
    norm = chain_from_nodes([N("add_rms_norm", "x", "r", "w", ("y", "s"))], ["x", "r", "w"],
                            ["s", "y"])
    assert norm.inputs == ("row", "row", "weight") and norm.outputs == (4, 3) and norm.rowwise
    assert norm.steps[0].attrs == (("eps", "1e-06"),)  # the default, filled in
    assert norm.output_dtypes([torch.bfloat16, torch.bfloat16, torch.float32]) == [
        torch.bfloat16, torch.bfloat16]


def test_chain_canonical_form():
    explicit = chain_from_nodes([N("gelu", "x", "y", approximate="none")], ["x"], ["y"])
    default = chain_from_nodes([N("gelu", "x", "y")], ["x"], ["y"])
    assert explicit == default and hash(explicit) == hash(default)
    positive = chain_from_nodes([N("scale", "x", "y", scale=0.0)], ["x"], ["y"])
    negative = chain_from_nodes([N("scale", "x", "y", scale=-0.0)], ["x"], ["y"])
    assert positive != negative  # they are different kernels (the sign of zero)


@pytest.mark.parametrize("nodes,inputs,outputs,match", [
    ([N("all_reduce", "x", "y")], ["x"], ["y"], "no chain kernel"),
    ([N("relu", "x", "w2"), N("rms_norm", "x", "w2", "y")], ["x"], ["y"], "must be an input"),
    ([N("rms_norm", "x", "w", "y"), N("add", "y", "w", "z")], ["x", "w"], ["z"], "row value"),
    ([N("scale", "x", "y", scale=float("nan"))], ["x"], ["y"], "not supported"),
    ([N("scale", "x", "y", scale="2")], ["x"], ["y"], "must be a number"),
    ([N("gelu", "x", "y", approximate="fast")], ["x"], ["y"], "approximate"),
    ([N("relu", "x", "y", inplace=True)], ["x"], ["y"], "unsupported attribute"),
    ([N("relu", "x", "y")], ["x"], ["x"], "not a step result"),
    ([N("relu", "q", "y")], ["x"], ["y"], "neither a chain input"),
    ([], ["x"], ["x"], "at least one step"),
])
def test_chain_rejects(nodes, inputs, outputs, match):
    with pytest.raises(UnsupportedChain, match=match):
        chain_from_nodes(nodes, inputs, outputs)


# ---- on a GPU, in process (skipped without one) ----------------------------------------------------

GPU_SHAPES = [(1, 4096), (128, 5120), (3, 4100), (2, 3, 37), (8192, 4096)]


ONE_STEP = {  # test name: (op, arity, attributes)
    "relu": ("relu", 1, {}), "sigmoid": ("sigmoid", 1, {}), "silu": ("silu", 1, {}),
    "gelu": ("gelu", 1, {}), "gelu_tanh": ("gelu", 1, {"approximate": "tanh"}),
    "scale": ("scale", 1, {"scale": 0.37}), "add": ("add", 2, {}), "mul": ("mul", 2, {}),
    "swiglu": ("swiglu", 2, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_step_chains_on_gpu(dtype):
    from infini_dist.kernels.elementwise_chain import elementwise_chain
    ulps = 8 if dtype == torch.float32 else 1  # GPU exp/rsqrt are a few fp32 ulps off libm's
    for shape in GPU_SHAPES:
        x = randn(shape, dtype, 1).cuda()
        y = randn(shape, dtype, 2).cuda()
        for name, (op, arity, attrs) in ONE_STEP.items():
            inputs = ["x", "y"][:arity]
            chain = chain_from_nodes([N(op, *inputs, "out", **attrs)], inputs, ["out"])
            tensors = [x, y][:arity]
            if name == "mul":  # strided inputs
                tensors = [t.transpose(-1, 0) for t in tensors]
            [got] = elementwise_chain(chain, *tensors)
            assert_matches(got, reference(op, *tensors, **attrs), ulps=ulps,
                           what=f"{name} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_example_rms_norm_on_gpu(dtype):
    from infini_dist.kernels.example_rms_norm import rms_norm
    ulps = 8 if dtype == torch.float32 else 1
    for shape in GPU_SHAPES:
        x = randn(shape, dtype, 1).cuda()
        w = randn(shape[-1:], torch.float32, 3).cuda()
        got = rms_norm(x, w, 1e-5)
        assert_matches(got, reference("rms_norm", x, w, eps=1e-5), ulps=ulps, what=str(shape))
        assert torch.equal(rms_norm(x, w, 1e-5), got)  # fixed tiles: same bits every run


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chain_kernel_on_gpu(name, dtype):
    from infini_dist.kernels.elementwise_chain import elementwise_chain
    nodes, inputs, outputs = CHAINS[name]
    chain = chain_from_nodes(nodes, inputs, outputs)
    for shape in GPU_SHAPES:
        tensors = [t.cuda() for t in chain_inputs(name, shape, dtype)]
        got = elementwise_chain(chain, *tensors)
        stepwise = unfused(nodes, inputs, outputs, tensors)
        in_fp32 = unfused(nodes, inputs, outputs, [t.float() for t in tensors])
        for g, s, f in zip(got, stepwise, in_fp32):
            assert_matches(g, f.to(s.dtype), ulps=8 if dtype == torch.float32 else 1,
                           what=f"{name} {shape}")
            assert op_registry.close_enough(g, s, computed_in=dtype), (name, shape)
