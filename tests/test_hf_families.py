"""HF model families under transformers' own TP on 2 gloo ranks (fp32, one layer, random
weights, no download), compiled with the pass: every all_reduce that a norm follows is fused with
that norm, logits match eager TP, and ranks agree bitwise.

Each family spells its norms and residuals its own way: Gemma2 scales by (1 + w) and norms before
and after each block (post-norms), OLMo2 norms the block output before the residual add, GPT-NeoX
runs attention and MLP in parallel off one LayerNorm'd input and sums both all_reduces with the
residual, Phi3 is Llama-like with fused qkv / gate_up projections, Cohere is parallel like GPT-NeoX
with a LayerNorm of its own spelling and no bias. The MoE families (Mixtral,
Qwen2-MoE, DeepSeek-V3) all_reduce their experts' [tokens, H] sum and reshape it to [b, s, H]
before the residual add (compile/reshape_first.py); Qwen2-MoE adds its replicated shared expert
first, DeepSeek-V3 its sharded one (a second all_reduce, summed with the first). Llama 4
all_reduces every expert's output for every token and sums them over the experts after; the sum
moves first (compile/block_sum_first.py).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from multirank import run_ranks
from test_compile_tp import _env, _one_compile_thread

VOCAB = 128
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
NORMS = {"rms_norm", "add_rms_norm", "gemma_rms_norm", "layer_norm", "layer_norm_no_bias"}

# family -> (config class, extra config, sites expected to carry a norm, norm-free sites allowed)
FAMILIES = {
    # embedding AR -> * sqrt(hidden) -> RMSNorm; o_proj / down_proj AR -> post-norm -> add -> norm
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16}, 3, 0),
    # post-norm: o_proj / down_proj AR -> RMSNorm -> add; the embedding AR feeds q/k/v unnormed
    "olmo2": ("Olmo2Config", {}, 2, 1),
    # parallel residual: attention AR + MLP AR + residual -> the final LayerNorm
    "gpt_neox": ("GPTNeoXConfig", {}, 1, 0),
    # embedding AR -> RMSNorm; o_proj / down_proj AR -> add -> RMSNorm
    "phi3": ("Phi3Config", {}, 3, 0),
    # parallel residual as GPT-NeoX, a LayerNorm without bias in Cohere's own spelling
    "cohere": ("CohereConfig", {}, 2, 0),
    # embedding AR -> RMSNorm; o_proj AR -> add -> RMSNorm; experts AR -> reshape -> add -> norm
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, 3, 0),
    # as Mixtral, the shared expert's output added before the reshape
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64,
                                     "shared_expert_intermediate_size": 64}, 3, 0),
    # attention unsharded; the experts' and the shared experts' ARs -> add -> add -> norm
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 64, "n_shared_experts": 1,
                                         "first_k_dense_replace": 0, "kv_lora_rank": 16,
                                         "q_lora_rank": 32, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
                                         "topk_group": 1}, 2, 0),
    # every token through every expert: the experts' [E * T, H] AR summed over E, then as
    # DeepSeek-V3 with the shared expert's AR (compile/block_sum_first.py)
    "llama4": ("Llama4TextConfig", {"num_local_experts": 4, "num_experts_per_tok": 1,
                                    "intermediate_size_mlp": 128, "head_dim": 16,
                                    "interleave_moe_layer_step": 1}, 3, 0),
}


def expected_sites(family: str) -> tuple[int, int]:
    """(sites with a norm, norm-free sites) under the installed transformers' TP plan."""
    import transformers
    config_name, _, with_norm, norm_free = FAMILIES[family]
    plan = getattr(transformers, config_name)().base_model_tp_plan or {}
    if family == "gpt_neox" and "embed_in" in plan:  # newer transformers shard the embedding:
        with_norm += 1  # its all_reduce feeds the first LayerNorm
    return with_norm, norm_free


def save_family(family: str, path) -> str:
    import transformers
    config_name, extra, _, _ = FAMILIES[family]
    config = getattr(transformers, config_name)(**SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norm weights and biases away from their init, so a lost one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


def _deepest_fused(medians):
    """Timing hook: native slowest, and the deeper a choice's epilogue the faster, so the
    numerics below are those of the fullest fusion (CPU timings would mostly pick native)."""
    depth = {n: int(re.search(r"e(\d+)", n).group(1)) if re.search(r"e\d+", n) else 0
             for n in medians}
    # ... and a sum-first choice (one all_reduce for GPT-NeoX's two) ahead of all others.
    return {n: 10.0 if n == "native" else 9.0 - 0.1 * depth[n] - 5.0 * n.startswith("sum_first+")
            for n in medians}


def _rank_setup(world: int) -> torch.Tensor:
    """This rank set up as every test here runs it; returns the input ids."""
    from infini_dist.scheduler.store import STORE
    STORE.timing_hook = _deepest_fused  # this process only: a fresh rank per test
    _one_compile_thread()
    os.environ["WORLD_SIZE"] = str(world)  # transformers sizes TP from it (torchrun sets it)
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def _tp_model(path):
    """This rank's shard of the saved family under transformers' TP, in fp32."""
    from transformers import AutoModelForCausalLM

    from infini_dist.launch.bench_hf import check_sharded, tp_load_kwargs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **tp_load_kwargs())
    check_sharded(model)
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def family_rank(rank, world, path, dynamic=None):
    import infini_dist.compile as idc
    ids = _rank_setup(world)
    model = _tp_model(path).eval()
    with torch.no_grad(), idc.recording() as graphs:
        eager = model(input_ids=ids).logits
        compiled = idc.compile_model(model, dynamic=dynamic)(input_ids=ids).logits
    return {"eager": _local(eager), "compiled": _local(compiled),
            "sites": graphs[0].site_ops() if graphs else [],
            "choices": sorted({(d["op"], d["choice"]) for d in idc.decisions()})}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_fuses_every_all_reduce_with_its_norm(tmp_path, family):
    pytest.importorskip("transformers")
    path = save_family(family, tmp_path / family)
    results = run_ranks(family_rank, 2, path, env=_env(), timeout=400)
    with_norm, norm_free = expected_sites(family)
    for r in results:
        sites = r["sites"]
        assert all(s.count("all_reduce") >= 1 for s in sites), sites
        normed = [s for s in sites if NORMS & set(s)]
        assert len(normed) == with_norm, sites
        assert len(sites) - len(normed) == norm_free, sites
        # a site with a norm fuses it; a bare all_reduce has nothing to fuse (native only)
        normed_choices = [c for op, c in r["choices"] if NORMS & set(op.split("+"))]
        assert len(normed_choices) >= 1 and "native" not in normed_choices, r["choices"]
        scale = float(r["eager"].abs().max())
        assert float((r["compiled"] - r["eager"]).abs().max()) <= 1e-4 * (1 + scale)
    assert torch.equal(results[0]["compiled"], results[1]["compiled"])
    assert results[0]["sites"] == results[1]["sites"]


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_hf_family_compiled_with_dynamic_shapes_fuses_its_norms(tmp_path, family):
    """dynamic=True, as a server compiles for every batch size: Dynamo makes the norms' float
    eps attributes graph inputs, which the sites read at run time
    (scheduler/run_time_attrs.py). Without that, each site stops before its norm."""
    pytest.importorskip("transformers")
    path = save_family(family, tmp_path / family)
    results = run_ranks(family_rank, 2, path, True, env=_env(), timeout=400)
    with_norm, norm_free = expected_sites(family)
    for r in results:
        assert len([s for s in r["sites"] if NORMS & set(s)]) == with_norm, r["sites"]
        scale = float(r["eager"].abs().max())
        assert float((r["compiled"] - r["eager"]).abs().max()) <= 1e-4 * (1 + scale)
    assert torch.equal(results[0]["compiled"], results[1]["compiled"])


def training_rank(rank, world, path):
    import infini_dist.compile as idc
    ids = _rank_setup(world)
    grads = []
    with idc.recording() as graphs:
        for compiled in (False, True):
            model = _tp_model(path).train()
            logits = (idc.compile_model(model) if compiled else model)(input_ids=ids).logits
            _local(logits).pow(2).mean().backward()
            grads.append({n: _local(p.grad) for n, p in model.named_parameters()
                          if p.grad is not None})
    return {"eager": grads[0], "compiled": grads[1],
            "sites": {g.kind: ["+".join(s) for s in g.site_ops()] for g in graphs}}


def test_moe_family_trains_with_its_block_fused(tmp_path):
    """Mixtral's experts' all_reduce, reshaped before the residual add, through forward and
    backward: the forward site takes the add, the norm and its saved rsqrt; gradients match."""
    pytest.importorskip("transformers")
    path = save_family("mixtral", tmp_path / "mixtral")
    results = run_ranks(training_rank, 2, path, env=_env(), timeout=400)
    for r in results:
        assert r["sites"]["forward"].count("all_reduce+add_rms_norm+rms_rstd") == 2, r["sites"]
        assert r["sites"]["backward"], r["sites"]
        assert set(r["eager"]) == set(r["compiled"]) and len(r["eager"]) > 10
        for name, want in r["eager"].items():
            got = r["compiled"][name]
            assert float(want.abs().max()) > 0, name  # a zero gradient would compare equal
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), name
