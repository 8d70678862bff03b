"""quant_fp8 and quant_fp8_tensor_scale (kernels/epilogue/quant_fp8.py): (x / scale).clamp(-448,
448) as float8_e4m3fn, the scale a number or a one-element tensor read at run time; alone and
after all_reduce + add + RMSNorm (the FP8 output beside the bf16 residual), in the ninetoothed
chain (the number only) and in the symmetric-memory kernels."""

import pytest
import torch

from epilogue_checks import (check_symm, compiled_site, epilogue_chain, full_depth_symm_choices,
                             fusing_algorithms, ops_of, randn, unfused)
from infini_dist.kernels.chain import UnsupportedChain, chain_from_nodes
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.backends.symm import plan_span
from infini_dist.scheduler.choices import RunContext
from interpreter_worker import call_kernel, run
from symm_cases import build, full_span, meta_of
from symm_runs import symm_algorithms
from test_compile import ar, llama_norm

FP8 = torch.float8_e4m3fn
CUDA2 = RunContext(None, 2, 0, torch.device("cuda"))


def fp64(x, scale):
    return (x.double() / scale).clamp(-448.0, 448.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_reference_against_fp64(dtype):
    x = randn((3, 5, 48), 1, dtype) * 200  # some beyond 448 * scale: clamped
    for scale in (0.25, 1.0):
        (got,) = op_registry.run_node("quant_fp8", [x], {"scale": scale})
        expected = fp64(x, scale)
        assert got.dtype == FP8 and got.shape == x.shape
        assert bool((expected.abs() == 448).any()) and bool((expected.abs() < 100).any())
        # one rounding to fp8: within half an fp8 step (3 mantissa bits) of the exact value
        assert ((got.double() - expected).abs() <= expected.abs() * 2.0 ** -4 + 2.0 ** -9).all()
        assert op_registry.close_enough(got, expected.to(FP8))
        (native,) = op_registry.run_node("quant_fp8", [x], {"scale": scale}, native=True)
        assert op_registry.close_enough(native, got, computed_in=dtype)
    with pytest.raises(TypeError):
        op_registry.run_node("quant_fp8", [torch.arange(6)], {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tensor_scale_reference_against_fp64(dtype):
    """The same quantization with the scale a one-element tensor of any float dtype: the number
    path's bits for the scale's value, and torch's own answer where x is fp32."""
    x = randn((3, 5, 48), 1, dtype) * 200
    for scale in (torch.tensor(0.25), torch.tensor([0.5], dtype=torch.bfloat16),
                  torch.tensor(1.0, dtype=torch.float64)):
        (got,) = op_registry.run_node("quant_fp8_tensor_scale", [x, scale], {})
        (by_number,) = op_registry.run_node("quant_fp8", [x],
                                            {"scale": float(scale.float().item())})
        assert got.dtype == FP8 and got.shape == x.shape
        assert torch.equal(got.float(), by_number.float()), scale
        expected = fp64(x, scale.float().item())
        assert bool((expected.abs() == 448).any()) and bool((expected.abs() < 100).any())
        (native,) = op_registry.run_node("quant_fp8_tensor_scale", [x, scale], {}, native=True)
        if dtype == torch.float32:  # fp32 x / any 0-d scale: torch divides in fp32 too
            assert torch.equal(native.float(), got.float())
        assert op_registry.close_enough(native, got, computed_in=dtype)


@pytest.mark.parametrize("scale", [torch.ones(2), torch.tensor(1), torch.ones(1, 1, 1, 1)],
                         ids=["two-elements", "int", "more-dims"])
def test_tensor_scale_refuses_what_is_not_a_per_tensor_scale(scale):
    x = randn((3, 8), 1)
    for native in (False, True):
        with pytest.raises(ValueError, match="one-element float tensor"):
            op_registry.run_node("quant_fp8_tensor_scale", [x, scale], {}, native=native)


NODES = [OpNode("add_rms_norm", ("ar", "res", "w"), ("n", "h"), {"eps": 1e-5}),
         OpNode("quant_fp8", ("n",), ("q",), {"scale": 0.01})]


def _chain_inputs(dtype, device="cpu"):
    return [randn((4, 37), 3, dtype).to(device), randn((4, 37), 4, dtype).to(device),
            randn((37,), 5).to(device)]


def _carries(values):
    """Where rounding to e4m3 carries into the next power of two (mantissa >= 1.9375): Triton
    3.9's interpreter drops that carry (124.0 -> 64), the GPU's conversion does not."""
    mantissa = values.abs() / torch.exp2(torch.floor(torch.log2(values.abs())))
    return mantissa >= 1.9375


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ninetoothed_chain_after_add_rms_norm(pool, dtype):
    tensors = _chain_inputs(dtype)
    chain = chain_from_nodes(NODES, ["ar", "res", "w"], ["q", "h"])
    q, h = run(pool, call_kernel, "elementwise_chain", "elementwise_chain", chain, *tensors)
    expected_q, expected_h = unfused(NODES, ["ar", "res", "w"], ["q", "h"], tensors)
    assert q.dtype == FP8 and op_registry.close_enough(h, expected_h, computed_in=dtype)
    scaled = unfused(NODES[:1], ["ar", "res", "w"], ["n"], [t.float() for t in tensors])[0] / 0.01
    exact = ~_carries(scaled.clamp(-448, 448))
    assert exact.float().mean() > 0.9
    assert op_registry.close_enough(q[exact], expected_q[exact], computed_in=dtype)


@pytest.mark.gpu
def test_chain_on_gpu_every_element():
    tensors = _chain_inputs(torch.bfloat16, "cuda")
    chain = chain_from_nodes(NODES, ["ar", "res", "w"], ["q", "h"])
    q, h = elementwise_chain(chain, *tensors)
    expected_q, expected_h = unfused(NODES, ["ar", "res", "w"], ["q", "h"],
                                     [t.cpu() for t in tensors])
    assert op_registry.close_enough(q.cpu(), expected_q, computed_in=torch.bfloat16)
    assert op_registry.close_enough(h.cpu(), expected_h)


def test_both_paths_fuse_it_after_add_rms_norm():
    ar_node = OpNode("all_reduce", ("x",), ("y",))
    graph = SubGraph((ar_node, OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r")),
                      OpNode("quant_fp8", ("n",), ("q",), {"scale": 0.5})),
                     ("x", "res", "w"), ("q", "r"))
    assert fusing_algorithms(graph) == {"nccl+nt_epilogue", "symm"}
    plan = plan_span(full_span(graph), meta_of(graph, (4, 64), torch.bfloat16), CUDA2)
    assert (plan.out, plan.pre, plan.out_dtype, plan.dtype, plan.quant_scale) == (
        "q", "r", FP8, torch.bfloat16, 0.5)
    # the norm's own output is not written: read elsewhere too, the quantizer cannot end the span
    read = SubGraph(graph.nodes, graph.input_names, ("q", "r", "n"))
    assert fusing_algorithms(read) == {"nccl+nt_epilogue"}


def test_a_tensor_scale_fuses_into_the_symm_kernels_only():
    """The scale tensor is a kernel input read at run time (quant_scale_input), no constant;
    the ninetoothed chain has no code for a one-element operand, so nccl+nt_epilogue declines."""
    graph = build("add_rms_norm_quant_fp8_tensor_scale")
    assert fusing_algorithms(graph) == {"symm"}
    plan = plan_span(full_span(graph), meta_of(graph, (4, 64), torch.bfloat16), CUDA2)
    assert (plan.out, plan.pre, plan.out_dtype, plan.quant_scale_input) == ("q", "r", FP8,
                                                                            "qscale")
    assert "qscale" in plan.tensor_inputs
    meta = meta_of(graph, (4, 64), torch.bfloat16)
    meta["qscale"] = meta["qscale"]._replace(device=torch.device("cpu"))  # not on x's device
    assert plan_span(full_span(graph), meta, CUDA2) is None


QUANT_PATTERNS = ["add_rms_norm_quant_fp8", "silu_quant_fp8",
                  "add_rms_norm_quant_fp8_tensor_scale", "silu_quant_fp8_tensor_scale"]


@pytest.mark.parametrize("pattern", QUANT_PATTERNS)
def test_the_engine_offers_every_symm_kernel_at_full_depth(pattern):
    assert full_depth_symm_choices(build(pattern)) == set(symm_algorithms())


@pytest.mark.parametrize("pattern", QUANT_PATTERNS)
def test_every_symm_kernel_interpreted(monkeypatch, pattern):
    """The FP8 output beside the bf16 residual (and after a plain chain), 2 ranks, every
    kernel; the plain callables take it as quant=("quant_fp8", scale) (symm_runs). A scale
    tensor differs per call (symm_cases.make_inputs): each call's output is checked against
    its own scale's reference, so a scale read once and kept would fail the second call."""
    check_symm(monkeypatch, pattern, tuple(symm_algorithms()))


def elementwise_chain(*args):
    from infini_dist.kernels.elementwise_chain import elementwise_chain as launch
    return launch(*args)


def test_a_quantized_value_ends_the_chain():
    nodes = [OpNode("quant_fp8", ("a",), ("q",), {"scale": 2.0}), OpNode("relu", ("q",), ("r",))]
    with pytest.raises(UnsupportedChain, match="quantized"):
        chain_from_nodes(nodes, ["a"], ["r"])
    chain = chain_from_nodes(nodes[:1], ["a"], ["q"])
    assert chain.output_dtypes([torch.bfloat16]) == [FP8]


@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_the_quantization_after_the_norm(dtype, upcast):
    def f(x, residual, w):
        h = ar(x) + residual
        n = llama_norm(h, w, 1e-5)
        return (n.float() if upcast else n) / 0.25, h

    def quantized(x, residual, w):
        scaled, h = f(x, residual, w)
        return scaled.clamp(-448, 448).to(FP8), h
    site = compiled_site(quantized, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype))
    assert ops_of(site) == ["all_reduce", "add_rms_norm", "quant_fp8"]
    assert site.nodes[-1].attr("scale") == 0.25
    dtypes = dict(zip(site.output_names, epilogue_chain(site).output_dtypes([dtype] * 3)))
    assert dtypes[site.nodes[-1].outputs[0]] == FP8
