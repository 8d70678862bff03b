"""gemma_rms_norm (kernels/epilogue/gemma_rms_norm.py): x * rsqrt(mean(x^2) + eps) * (1 + w)."""

import pytest
import torch

from epilogue_checks import (DTYPES, check_chain, check_reference, check_symm, compiled_site,
                             epilogue_chain, fusing_algorithms, ops_of, randn)
from infini_dist.scheduler.ir import OpNode
from symm_cases import build
from test_compile import ar


def fp64(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w.double())


def transformers_gemma(x, w, eps=1e-6):
    """transformers' Gemma2RMSNorm.forward (the weight is an offset from 1)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_against_fp64(dtype):
    x, w = randn((3, 5, 48), 1, dtype), randn((48,), 2, dtype) * 0.3
    check_reference("gemma_rms_norm", [x, w], fp64(x, w, 1e-5), {"eps": 1e-5})
    check_reference("gemma_rms_norm", [x * 100, w], fp64(x * 100, w, 1e-6), {})  # default eps
    with pytest.raises(TypeError):
        check_reference("gemma_rms_norm", [torch.arange(6).view(2, 3), w[:3]], None, {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ninetoothed_chain(pool, dtype):
    nodes = [OpNode("add", ("ar", "res"), ("h",)),
             OpNode("gemma_rms_norm", ("h", "w"), ("y",), {"eps": 1e-5})]
    tensors = [randn((4, 37), 3, dtype), randn((4, 37), 4, dtype), randn((37,), 5) * 0.3]
    check_chain(pool, nodes, ["ar", "res", "w"], ["y", "h"], tensors)


def test_every_gpu_algorithm_fuses_it():
    assert fusing_algorithms(build("add_then_gemma_rms_norm")) == {"nccl+nt_epilogue", "symm"}


def test_symmetric_memory_kernels(monkeypatch):
    check_symm(monkeypatch, "add_then_gemma_rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_transformers_spelling(dtype):
    def f(x, residual, w):
        h = ar(x) + residual
        return transformers_gemma(h, w, 1e-5), h
    site = compiled_site(f, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype))
    assert ops_of(site) == ["all_reduce", "add", "gemma_rms_norm"]
    assert site.nodes[-1].attr("eps") == pytest.approx(1e-5, rel=1e-6)
    assert epilogue_chain(site).rowwise  # the generic path runs it as one kernel
