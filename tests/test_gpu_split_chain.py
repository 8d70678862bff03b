"""A row-split chain on 2 GPUs (NCCL): an HF Llama under transformers' TP (bf16, 2 layers, a
prefill of 2 x 1024 tokens), compiled with config.matmul_prologue so that its four sites form
one chain (compile/chain_match.py), the split committed (a timing hook makes it win, with only
the first of several readers in row parts, and every other site's reader GEMMs cut by columns
as well), then:

- without CUDA graphs: the logits of two inputs against eager TP (relative L2);
- under mode="reduce-overhead" (CUDA-graph trees record the chain's copy stream, flags and
  waits): three rounds over both inputs, each bitwise equal to its first replay and close to
  the run without graphs;
- every rank's logits bitwise equal (each row is reduced by one rank and copied);
- the chain's four split sites hold two sets of buffers (sites k and k + 2 share one);
- the graphed compile's chain runner is a fresh one: it takes the decision from the decision
  cache, untimed, with each site's way, and builds its buffers from it;
- then a chain decided by its own timings (no hook): whatever it commits, the logits match.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_llama import save_llama
from multirank import run_ranks

pytestmark = pytest.mark.multigpu


def _rel(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _split_wins():
    """A timing hook by which the split wins, with its first reader alone in parts where a site
    has several; its GEMMs cut by columns too at every other chain site timed, so that both
    ways run (the hook sees the chain's sites in the same order on every rank). The engine's
    own site tunings, which the hook sees as well, commit a fused choice."""
    chain_sites = []

    def hook(medians):
        if "sites" not in medians:  # a site's tuning: any fused choice over native
            return {n: 5.0 if n == "native" else 2.0 for n in medians}
        cols = len(chain_sites) % 2 == 0
        chain_sites.append(cols)
        base = {"split_first": 1.0, "split": 1.5, "sites": 2.0}
        return {n: base.get(n.removesuffix("_cols"), 5.0)
                + (0.0 if n == "sites" or n.endswith("_cols") == cols else 0.25)
                for n in medians}
    hook.chain_sites = chain_sites  # how many chain sites it timed
    return hook


def _logits(model, ids):
    out = model(input_ids=ids).logits
    return (out.to_local() if hasattr(out, "to_local") else out).clone()


def _rank(rank, world, path):
    from transformers import AutoModelForCausalLM

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.launch.bench_hf import tp_load_kwargs
    from infini_dist.scheduler.split_chain import chain_decisions
    from infini_dist.scheduler.store import STORE
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # transformers' TP reads them
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 **tp_load_kwargs()).eval()
    inputs = [torch.randint(0, 2048, (2, 1024), generator=torch.Generator().manual_seed(s))
              .cuda() for s in (1, 2)]
    report = {}
    infini_dist.config.matmul_prologue = True
    with torch.no_grad():
        eager = [_logits(model, ids) for ids in inputs]
        STORE.timing_hook = hook = _split_wins()
        with idc.recording() as graphs:
            compiled = idc.compile_model(model, recompile_decided=False)
            plain = [_logits(compiled, ids) for ids in inputs]
        report["chains"] = [len(g.chains) for g in graphs]
        report["decisions"] = [d.get("mode") for d in chain_decisions()]
        report["ways"] = sorted({u["split"] for d in chain_decisions() for u in d["units"]})
        report["buffer_sets"] = [len({(s.h.data_ptr(), s.pre.data_ptr()) for s in r.split})
                                 for r in STORE.chains.values() if r.split]
        report["rel_eager"] = [_rel(p, e) for p, e in zip(plain, eager)]
        torch._dynamo.reset()
        timed, ways = len(hook.chain_sites), report["ways"]
        STORE.chains.clear()  # as in a new process, where only the decision cache knows
        graphed = idc.compile_model(model, mode="reduce-overhead", recompile_decided=False)
        first, mismatches, rel = [None, None], 0, []
        for _ in range(3):
            for i, ids in enumerate(inputs):
                torch.compiler.cudagraph_mark_step_begin()
                out = _logits(graphed, ids)
                if first[i] is None:
                    first[i] = out
                mismatches += int(not torch.equal(out, first[i]))
                rel.append(_rel(out, plain[i]))
        report["graph_mismatches"], report["rel_graph_vs_plain"] = mismatches, max(rel)
        (cached,) = chain_decisions()
        report["cached"] = {"source": cached.get("source"), "mode": cached.get("mode"),
                            "timed_again": len(hook.chain_sites) - timed,
                            "same_ways": ways == sorted({u["split"] for u in cached["units"]}),
                            "columns": sorted({site.columns for r in STORE.chains.values()
                                               for site in r.split})}
        STORE.timing_hook = None
        torch._dynamo.reset()
        with infini_dist.config.patch(fusion_speedup_threshold=1.0001):  # a fresh chain runner
            timed = idc.compile_model(model, recompile_decided=False)
            own = _logits(timed, inputs[0])
        report["own_decision"] = [d for d in chain_decisions() if d.get("mode")][-1]
        report["rel_own"] = _rel(own, eager[0])
    report["logits"] = [p.cpu() for p in plain] + [f.cpu() for f in first]
    return report


def test_hf_llama_prefill_as_a_row_split_chain_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("transformers")
    path = save_llama(str(tmp_path / "llama"), hidden_size=1024, intermediate_size=2048,
                      num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2,
                      vocab_size=2048, max_position_embeddings=2048)
    reports = run_ranks(_rank, 2, path, timeout=280, backend="nccl")
    for rank, r in enumerate(reports):
        print(f"rank {rank}: " + str({k: v for k, v in r.items() if k != "logits"}))
    for r in reports:
        assert r["chains"] == [1] and r["decisions"] == ["split"], r
        assert any(w.endswith("_cols") for w in r["ways"]), r["ways"]
        assert r["buffer_sets"] == [2], r["buffer_sets"]  # sites k and k + 2 share
        cached = r["cached"]
        assert cached["source"] == "cache" and cached["mode"] == "split", cached
        assert cached["timed_again"] == 0 and cached["same_ways"], cached
        assert cached["columns"] == [1, 2], cached  # each site's way, set from the record
        assert any(not w.endswith("_cols") for w in r["ways"]), r["ways"]
        assert max(r["rel_eager"]) < 2e-2, r["rel_eager"]
        assert r["graph_mismatches"] == 0 and r["rel_graph_vs_plain"] < 1e-2, r
        assert r["own_decision"]["mode"] in ("split", "sites") and r["rel_own"] < 2e-2, r
    for a, b in zip(reports[0]["logits"], reports[1]["logits"]):
        assert torch.equal(a, b)
