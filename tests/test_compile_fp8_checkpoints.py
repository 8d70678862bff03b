"""FP8 checkpoints' quantization spellings fuse into the all_reduce + add + RMSNorm site (issue
#26 item 3): a static scale held as a registered buffer, an nn.Parameter, a graph input or a
tensor made in forward (quant_fp8_tensor_scale, read at run time), the Python float
(quant_fp8), and the per-token spellings users write (quant_fp8_per_token and its reciprocal
form). Each is a small module compiled with backend="infini_dist" on 2 gloo ranks, the deepest
fused choice forced; the site must hold the quantizer, and the compiled outputs must be the
eager module's (fp8 within one e4m3 step, nearly all equal; per-token scales within an fp32 ulp).
"""

from __future__ import annotations

import re

import pytest
import torch

from multirank import run_ranks
from symm_cases import fp8_error
from test_compile_tp import _ar, _env, _one_compile_thread

FP8 = torch.float8_e4m3fn
SHAPE = (2, 4, 32)
EPS = 1e-5


def _deepest_fused(medians):
    """Native slowest, and the deeper a choice fuses the faster: the full site wins."""
    def time(name):
        found = re.search(r",e(\d+)\]$", name)
        return 100.0 if name == "native" else 10.0 - (int(found.group(1)) if found else 0)
    return {name: time(name) for name in medians}


# ---- the spellings: quantize(module, normed, *extra inputs) -------------------------------------

def _by_float(m, n):
    return (n / 0.05).clamp(-448, 448).to(FP8)


def _by_tensor(m, n, scale=None):
    scale = m.scale if scale is None else scale
    return (n / scale).clamp(-448, 448).to(FP8)


def _made_in_forward(m, n):
    return (n / torch.tensor(0.05)).clamp(-448, 448).to(FP8)


def _per_token_user(m, n):
    scale = n.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
    return (n / scale).clamp(-448, 448).to(FP8), scale


def _per_token_finfo(m, n):
    fp8_max = torch.finfo(FP8).max
    h = n.float()
    scale = torch.clamp(h.abs().amax(dim=-1, keepdim=True) / fp8_max, min=1e-6)
    return (h / scale).clamp(-fp8_max, fp8_max).to(FP8), scale


def _per_token_clamp_min(m, n):
    scale = n.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-4) / 448.0
    return (n.float() / scale).clamp(-448, 448).to(FP8), scale


def _per_token_reciprocal(m, n):
    h = n.to(torch.float32)
    scale = (h.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-6)
    return (h * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def _per_token_vllm(m, n):
    x_max, _ = n.abs().max(dim=-1)
    scale = (x_max.unsqueeze(-1).to(torch.float32) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    return (n.to(torch.float32) * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


# name: (quantize, where the scale lives, the IR op the site must end with)
SPELLINGS = {
    "float": (_by_float, None, "quant_fp8"),
    "buffer": (_by_tensor, "buffer", "quant_fp8_tensor_scale"),
    "parameter": (_by_tensor, "parameter", "quant_fp8_tensor_scale"),
    "graph_input": (_by_tensor, "input", "quant_fp8_tensor_scale"),
    "made_in_forward": (_made_in_forward, None, "quant_fp8_tensor_scale"),
    "per_token_user": (_per_token_user, None, "quant_fp8_per_token"),
    "per_token_finfo": (_per_token_finfo, None, "quant_fp8_per_token"),
    "per_token_clamp_min": (_per_token_clamp_min, None, "quant_fp8_per_token"),
    "per_token_reciprocal": (_per_token_reciprocal, None, "quant_fp8_per_token_reciprocal"),
    "per_token_vllm": (_per_token_vllm, None, "quant_fp8_per_token_reciprocal"),
}
# A scale read at run time: changed between calls, the compiled output follows it.
CHANGEABLE = ("buffer", "parameter", "graph_input")


class Block(torch.nn.Module):
    """all_reduce -> + residual -> RMSNorm (Llama's) -> FP8 quantization of the normed value."""

    def __init__(self, group, quantize, scale_in):
        super().__init__()
        self.group, self.quantize = group, quantize
        gen = torch.Generator().manual_seed(7)
        self.weight = torch.nn.Parameter(torch.rand(SHAPE[-1], generator=gen) + 0.5,
                                         requires_grad=False)
        if scale_in == "buffer":
            self.register_buffer("scale", torch.tensor(0.05))
        elif scale_in == "parameter":
            self.scale = torch.nn.Parameter(torch.tensor(0.05), requires_grad=False)

    def forward(self, x, residual, *scale):
        h = _ar(x, self.group) + residual
        f = h.float()
        normed = self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
        q = self.quantize(self, normed, *scale)
        return (*q, h) if isinstance(q, tuple) else (q, h)


def _set_scale(block, scale, value):
    """The new scale for the next call: the checkpoint's tensor updated in place, or another
    graph input."""
    if scale:
        return [torch.tensor(value)]
    with torch.no_grad():
        block.scale.fill_(value)
    return []


def fp8_rank(rank, world, names):
    import torch.distributed as dist

    import infini_dist.compile as idc
    from infini_dist.scheduler.store import STORE
    _one_compile_thread()
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(SHAPE, generator=gen)
    residual = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    STORE.timing_hook = _deepest_fused
    results = {}
    try:
        for name in names:
            quantize, scale_in, _ = SPELLINGS[name]
            torch._dynamo.reset()
            block = Block(group, quantize, scale_in)
            scale = [torch.tensor(0.05)] if scale_in == "input" else []
            compiled = torch.compile(block, backend="infini_dist")
            with torch.no_grad():
                calls = [(compiled(x, residual, *scale), block(x, residual, *scale))]
                sites = list(idc.last_sites)
                if name in CHANGEABLE:
                    scale = _set_scale(block, scale, 0.08)
                    calls.append((compiled(x, residual, *scale), block(x, residual, *scale)))
            chosen = [d["choice"] for d in idc.decisions() if d["subgraph"] in sites]
            results[name] = {"sites": sites, "chosen": chosen,
                             "calls": [([t.float() for t in got], [t.float() for t in want])
                                       for got, want in calls]}
    finally:
        STORE.timing_hook = None
    return results


def _check_outputs(got, want):
    """(q[, scales], h): the fp8 values within one e4m3 step of eager's and nearly all equal;
    per-token scales within an fp32 ulp; the residual sum as eager's."""
    q, q_want = got[0].double(), want[0].double()
    assert q.shape == q_want.shape and bool(q.abs().gt(0).any())  # never zeros
    assert fp8_error(q, q_want) == 0
    assert (q == q_want).double().mean() >= 0.99
    if len(got) == 3:
        assert torch.allclose(got[1], want[1], rtol=2.0 ** -23, atol=0)
    assert torch.allclose(got[-1], want[-1], rtol=1e-6, atol=1e-6)


GROUPS = {"static": ["float", "buffer", "parameter", "graph_input", "made_in_forward"],
          "per_token": [n for n in SPELLINGS if n.startswith("per_token")]}


@pytest.fixture(scope="module", params=sorted(GROUPS))
def compiled(request):
    names = GROUPS[request.param]
    results = run_ranks(fp8_rank, 2, names, env=_env(), timeout=540)
    return names, results


@pytest.mark.timeout(600)
def test_every_spelling_fuses_into_the_site(compiled):
    from infini_dist.scheduler.ir import subgraph_from_text
    names, results = compiled
    for name in names:
        op = SPELLINGS[name][2]
        for rank in results:
            r = rank[name]
            (site,) = [subgraph_from_text(t) for t in r["sites"]]
            assert [n.op_type for n in site.nodes] == ["all_reduce", "add_rms_norm", op], name
            # the deepest fused choice ran: the quantizer inside the fused span
            assert r["chosen"] and all(c.endswith(",e2]") and c != "native"
                                       for c in r["chosen"]), (name, r["chosen"])
            for got, want in r["calls"]:
                _check_outputs(got, want)
        assert results[0][name]["sites"] == results[1][name]["sites"]


@pytest.mark.timeout(600)
def test_a_checkpoint_scale_is_read_at_run_time(compiled):
    """The buffer or parameter updated in place, or another scale tensor passed: the compiled
    site's output follows, as eager's does (nothing baked the first value in)."""
    names, results = compiled
    for name in (n for n in names if n in CHANGEABLE):
        for rank in results:
            (first, _), (second, second_want) = rank[name]["calls"]
            _check_outputs(second, second_want)
            assert not torch.equal(first[0], second[0]), name
