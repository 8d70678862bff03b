"""layer_norm (kernels/epilogue/layer_norm.py): (x - mean) * rsqrt(var + eps) * w + b."""

import pytest
import torch
import torch.nn.functional as F

from epilogue_checks import (DTYPES, check_chain, check_reference, check_symm, compiled_site,
                             epilogue_chain, fusing_algorithms, ops_of, randn)
from infini_dist.scheduler.ir import OpNode
from symm_cases import build
from test_compile import ar


def fp64(x, w, b, eps):
    x = x.double()
    centered = x - x.mean(-1, keepdim=True)
    variance = (centered * centered).mean(-1, keepdim=True)  # biased, as torch
    return centered / torch.sqrt(variance + eps) * w.double() + b.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_against_fp64(dtype):
    x = randn((3, 5, 48), 1, dtype, offset=2.0)  # a mean far from 0: centering matters
    w, b = randn((48,), 2, dtype), randn((48,), 3, dtype)
    check_reference("layer_norm", [x, w, b], fp64(x, w, b, 1e-6), {"eps": 1e-6})
    check_reference("layer_norm", [x, w, b], fp64(x, w, b, 1e-5), {})  # torch's default eps
    with pytest.raises(TypeError):
        check_reference("layer_norm", [torch.arange(6).view(2, 3), w[:3], b[:3]], None, {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ninetoothed_chain(pool, dtype):
    nodes = [OpNode("add", ("ar", "res"), ("h",)),
             OpNode("layer_norm", ("h", "w", "b"), ("y",), {"eps": 1e-5})]
    tensors = [randn((4, 37), 3, dtype, offset=1.0), randn((4, 37), 4, dtype),
               randn((37,), 5), randn((37,), 6)]
    check_chain(pool, nodes, ["ar", "res", "w", "b"], ["y", "h"], tensors)


def test_every_gpu_algorithm_fuses_it():
    assert fusing_algorithms(build("add_then_layer_norm")) == {"nccl+nt_epilogue", "symm"}


def test_symmetric_memory_kernels(monkeypatch):
    check_symm(monkeypatch, "add_then_layer_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pass_matches_layer_norm(dtype):
    def f(x, residual, w, b):  # GPT-NeoX / Phi-2: nn.LayerNorm after the residual add
        h = ar(x) + residual
        return F.layer_norm(h, (h.shape[-1],), w, b, 1e-5), h
    site = compiled_site(f, randn((2, 16), 1, dtype), randn((2, 16), 2, dtype),
                         randn((16,), 3, dtype), randn((16,), 4, dtype))
    assert ops_of(site) == ["all_reduce", "add", "layer_norm"]
    assert site.nodes[-1].attr("eps") == pytest.approx(1e-5, rel=1e-6)
    assert epilogue_chain(site).rowwise  # the generic path runs it as one kernel
