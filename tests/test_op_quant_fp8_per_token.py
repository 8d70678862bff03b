"""quant_fp8_per_token (kernels/epilogue/quant_fp8_per_token.py): per row, scale = max|row| / 448
(at least 1 / (448 * 512)), (row / scale).clamp(-448, 448) as float8_e4m3fn, and the fp32 scales
(rows x 1); alone, and after all_reduce + add + RMSNorm in the symmetric-memory kernels."""

import pytest
import torch

from epilogue_checks import (DTYPES, check_symm, compiled_site, full_depth_symm_choices,
                             fusing_algorithms, ops_of, randn)
from fx_graphs import ar, llama_norm
from infini_dist.compile.fx_patterns import FORMS
from infini_dist.kernels.chain import UnsupportedChain, chain_from_nodes
from infini_dist.kernels.epilogue.quant_fp8_per_token import MIN_SCALE
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.ir import OpNode, SubGraph
from symm_cases import build
from symm_runs import symm_algorithms

FP8 = torch.float8_e4m3fn
PATTERN = "add_rms_norm_quant_fp8_per_token"


def fp64(x):
    x = x.double()
    scales = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(MIN_SCALE)
    return (x / scales).clamp(-448.0, 448.0), scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_against_fp64(dtype):
    x = randn((3, 5, 48), 1, dtype) * torch.linspace(0.01, 300, 15).view(3, 5, 1).to(dtype)
    x[1, 2] = 0  # an all-zero row: the floor keeps its scale finite, its values zero
    q, scales = op_registry.run_node("quant_fp8_per_token", [x], {})
    expected, expected_scales = fp64(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, 5, 1)
    assert torch.allclose(scales.double(), expected_scales, rtol=2.0 ** -23, atol=0)
    assert scales[1, 2].item() == pytest.approx(MIN_SCALE) and not q[1, 2].float().any()
    # each row's largest value maps to +-448; every value within half an fp8 step of exact
    assert (q.float().abs().amax(-1) == 448).sum() == 14
    assert ((q.double() - expected).abs() <= expected.abs() * 2.0 ** -4 + 2.0 ** -10).all()
    # vLLM's native spelling multiplies by the reciprocal: at most one step apart
    native_q, native_scales = op_registry.run_node("quant_fp8_per_token", [x], {}, native=True)
    assert torch.equal(native_scales, scales)
    assert op_registry.close_enough(native_q, q)
    with pytest.raises(TypeError):
        op_registry.run_node("quant_fp8_per_token", [torch.arange(6)], {})


def test_no_ninetoothed_chain_the_symm_kernels_fuse_it():
    # The chain kernel stores values of the chain's shape only; the scales are rows x 1.
    with pytest.raises(UnsupportedChain, match="no chain kernel"):
        chain_from_nodes([OpNode("quant_fp8_per_token", ("a",), ("q", "s"))], ["a"], ["q", "s"])
    assert fusing_algorithms(build(PATTERN)) == {"symm"}


def test_the_engine_offers_every_symm_kernel_at_full_depth():
    assert full_depth_symm_choices(build(PATTERN)) == set(symm_algorithms())


def test_per_token_needs_the_norms_whole_row():
    graph = SubGraph((OpNode("all_reduce", ("x",), ("y",)),
                      OpNode("quant_fp8_per_token", ("y",), ("q", "qs"))), ("x",), ("q", "qs"))
    assert fusing_algorithms(graph) == set()
    assert full_depth_symm_choices(graph) == set()


def test_every_symm_kernel_interpreted(monkeypatch):
    """The FP8 output and its scales beside the bf16 residual, 2 ranks, every kernel."""
    check_symm(monkeypatch, PATTERN, tuple(symm_algorithms()))


@pytest.mark.parametrize("form", [f for f in FORMS if f.op_type == "quant_fp8_per_token"],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_it_after_the_norm(form, dtype):
    def f(x, residual, w):
        h = ar(x) + residual
        q, scales = form.fn(llama_norm(h, w, 1e-5))
        return q, scales, h
    site = compiled_site(f, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype))
    assert ops_of(site) == ["all_reduce", "add_rms_norm", "quant_fp8_per_token"]
    assert set(site.nodes[-1].outputs) <= set(site.output_names)  # the scales are read too
