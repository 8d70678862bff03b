"""Training with tensor parallelism on 2 gloo ranks: HF Llama (random weights from a small
config) sharded by transformers' own TP plan, 3 SGD steps eager, with torch.compile + the pass
(Inductor) and with backend="infini_dist". Losses, gradients and updated weights must equal eager
TP; the forward sites keep the RMSNorm (its rsqrt exposed for backward) and the backward graphs
are rewritten too.
"""

from __future__ import annotations

import time

import pytest
import torch

from multirank import run_ranks
from test_compile_tp import _env, _one_compile_thread

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' TP loading needs it

STEPS = 3
VOCAB = 128


def save_small_llama(path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norm weights that are not all ones, so a lost weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


def load_tp(path, world):
    """The model sharded by transformers' TP plan, loaded as bench --hf loads it. transformers
    sizes TP from WORLD_SIZE, which torchrun sets and run_ranks does not."""
    import os

    from transformers import AutoModelForCausalLM

    from infini_dist.launch.bench_hf import tp_load_kwargs
    os.environ["WORLD_SIZE"] = str(world)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **tp_load_kwargs())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def train(model, steps, forward=None):
    """`steps` SGD steps of `model`, run through `forward` (a compiled model) if given."""
    forward = model if forward is None else forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], None
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    weights = {n: _local(p.detach()).clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights}


def train_rank(rank, world, path, route):
    import infini_dist.compile as idc
    _one_compile_thread()
    with idc.recording() as graphs:
        eager = train(load_tp(path, world), STEPS)
        model = load_tp(path, world)
        if route == "inductor":
            compiled = idc.compile_model(model)
        else:
            compiled = torch.compile(model, backend=idc.BACKEND_NAME)
        start = time.perf_counter()
        result = train(model, STEPS, compiled)
    print(f"rank {rank}: compiled training took {time.perf_counter() - start:.1f} s", flush=True)
    return {"eager": eager, "compiled": result, "graphs": [g.site_ops() for g in graphs],
            "decided": sorted({d["choice"] for d in idc.decisions()})}


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / (1 + b[k].abs().max()))
               for k in b)


@pytest.mark.parametrize("route", ["inductor", "infini_dist"])
def test_hf_llama_tp_training_matches_eager(tmp_path, route):
    path = save_small_llama(tmp_path / "model")
    results = run_ranks(train_rank, 2, path, route, env=_env(), timeout=400)
    for r in results:
        eager, compiled = r["eager"], r["compiled"]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4, abs=1e-5)
        assert eager["losses"][-1] < eager["losses"][0]  # it trains
        assert _max_rel(compiled["grads"], eager["grads"]) < 1e-4
        assert _max_rel(compiled["weights"], eager["weights"]) < 1e-4
        # (a site may start with its GEMM where config.matmul_prologue is on)
        forward, backward = ([s[s[0] == "matmul":] for s in g] for g in r["graphs"][:2])
        # Forward: after attention and after the MLP, all_reduce -> add -> RMSNorm, with the
        # norm's rsqrt exposed for backward.
        assert sum(s[:3] == ["all_reduce", "add_rms_norm", "rms_rstd"] for s in forward) >= 3
        assert backward and all(s[0] == "all_reduce" for s in backward)  # rewritten
        assert r["decided"]
    assert results[0]["graphs"] == results[1]["graphs"]
