"""layer_norm_no_bias (kernels/epilogue/layer_norm.py): (x - mean) * rsqrt(var + eps) * w, the
LayerNorm of nn.LayerNorm(bias=False) and of Cohere's Command-R models."""

import pytest
import torch
import torch.nn.functional as F

from epilogue_checks import (DTYPES, check_chain, check_reference, check_symm, compiled_site,
                             epilogue_chain, fusing_algorithms, ops_of, randn)
from infini_dist.scheduler.ir import OpNode
from symm_cases import build
from test_compile import ar


def fp64(x, w, eps):
    x = x.double()
    centered = x - x.mean(-1, keepdim=True)
    variance = (centered * centered).mean(-1, keepdim=True)  # biased, as torch
    return centered / torch.sqrt(variance + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_against_fp64(dtype):
    x = randn((3, 5, 48), 1, dtype, offset=2.0)  # a mean far from 0: centering matters
    w = randn((48,), 2, dtype)
    check_reference("layer_norm_no_bias", [x, w], fp64(x, w, 1e-6), {"eps": 1e-6})
    check_reference("layer_norm_no_bias", [x, w], fp64(x, w, 1e-5), {})  # torch's default
    with pytest.raises(TypeError):
        check_reference("layer_norm_no_bias", [torch.arange(6).view(2, 3), w[:3]], None, {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ninetoothed_chain(pool, dtype):
    nodes = [OpNode("add", ("ar", "res"), ("h",)),
             OpNode("layer_norm_no_bias", ("h", "w"), ("y",), {"eps": 1e-5})]
    tensors = [randn((4, 37), 3, dtype, offset=1.0), randn((4, 37), 4, dtype), randn((37,), 5)]
    check_chain(pool, nodes, ["ar", "res", "w"], ["y", "h"], tensors)


def test_every_gpu_algorithm_fuses_it():
    assert fusing_algorithms(build("add_then_layer_norm_no_bias")) == {"nccl+nt_epilogue", "symm"}


def test_symmetric_memory_kernels(monkeypatch):
    check_symm(monkeypatch, "add_then_layer_norm_no_bias")


def _cohere(x, w, eps):
    # transformers' CohereLayerNorm.forward
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + eps)
    return (w.to(torch.float32) * h).to(x.dtype)


@pytest.mark.parametrize("spelling", ["nn.LayerNorm(bias=False)", "Cohere"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_both_spellings(dtype, spelling):
    def f(x, residual, w):
        h = ar(x) + residual
        if spelling == "Cohere":
            return _cohere(h, w, 1e-5), h
        return F.layer_norm(h, (h.shape[-1],), w, None, 1e-5), h
    site = compiled_site(f, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype))
    assert ops_of(site) == ["all_reduce", "add", "layer_norm_no_bias"]
    assert site.nodes[-1].attr("eps") == pytest.approx(1e-5, rel=1e-6)
    assert epilogue_chain(site).rowwise  # the generic path runs it as one kernel
