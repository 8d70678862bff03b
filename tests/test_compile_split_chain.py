"""Row-split chains (compile/chain_match.py, scheduler/split_chain.py): which prefill sites the
pass joins into a chain and how it rewrites them, and an HF Llama under transformers' own TP on
gloo ranks, compiled with the chain: the logits match eager TP's, the chain runs site by
site on CPU (the split needs CUDA), and the ranks agree. The split itself runs on GPUs
(tests/test_gpu_split_chain.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import infini_dist

from fx_graphs import ar, export, fuse, llama_norm, rand
from hf_llama import save_llama
from multirank import run_ranks
from test_compile_tp import _env, _one_compile_thread

SPLIT_SITE = "infini_dist.split_site.default"
SPLIT_READ = "infini_dist.split_read.default"
D, H = 16, 32


def _layer(x, w, res):
    """One Llama-like layer: q/k/v apart, an attention stand-in, gate/up apart."""
    wq, wk, wv, wo, n1, wg, wu, wd, n2 = w
    a = torch.tanh(F.linear(x, wq)) * F.linear(x, wk) + F.linear(x, wv)
    h = ar(F.linear(a, wo)) + res
    m = llama_norm(h, n1)
    h2 = ar(F.linear(F.silu(F.linear(m, wg)) * F.linear(m, wu), wd)) + h
    return llama_norm(h2, n2), h2


def _weights(seed=1):
    shapes = [(D, D), (D, D), (D, D), (D, D), (D,), (H, D), (H, D), (D, H), (D,)]
    return [rand(*s, seed=seed + i) for i, s in enumerate(shapes)]


def two_layers(x, lm, *w):
    out, res = _layer(llama_norm(x, w[4]), w, x)
    out, res = _layer(out, w, res)
    return F.linear(out, lm)


def last_norm_returned(x, *w):
    out, res = _layer(llama_norm(x, w[4]), w, x)
    out, _ = _layer(out, w, res)
    return torch.cumsum(out, 1)  # no GEMM reads the last norm (nor fuses): a copy of every row


def residual_read_twice(x, *w):
    out, res = _layer(llama_norm(x, w[4]), w, x)
    out, _ = _layer(out, w, res)
    return out, res  # the middle residual leaves the graph: no chain


def norm_read_by_no_gemm(x, *w):
    out, res = _layer(llama_norm(x, w[4]), w, x)
    out2, _ = _layer(out, w, res)
    return torch.cumsum(out2, 1), out.sum()  # the middle norm read by a sum


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _chain(gm):
    from infini_dist.scheduler.split_chain import parse_chain
    texts = {n.args[1] for n in gm.graph.nodes if str(n.target) == SPLIT_SITE}
    assert len(texts) == 1
    return parse_chain(texts.pop())


def test_two_layers_become_one_chain_of_four_sites_with_their_readers():
    x, lm = rand(2, 512, D), rand(40, D, seed=20)
    gm = export(two_layers, x, lm, *_weights())
    fuse(gm, matmul_prologue=True)
    targets = _targets(gm)
    assert targets.count(SPLIT_SITE) == 4 and targets.count(SPLIT_READ) == 4
    assert "infini_dist.fused_site.default" not in targets
    assert targets.count("aten.mm.default") == 3  # the first layer's q, k, v: no site before
    group, dtype, sites = _chain(gm)
    assert group == "g0" and dtype == torch.float32
    assert [s.rows for s in sites] == [1024] * 4
    assert [(s.k, s.hidden) for s in sites] == [(D, D), (H, D), (D, D), (H, D)]
    assert [s.readers for s in sites] == [((H, True, False),) * 2, ((D, True, False),) * 3,
                                          ((H, True, False),) * 2, ((40, True, False),)]
    assert [s.residual_out for s in sites] == [True, True, True, False]


def test_a_last_norm_no_gemm_reads_is_copied_out():
    x = rand(2, 512, D)
    gm = export(last_norm_returned, x, *_weights())
    fuse(gm, matmul_prologue=True)
    _, _, sites = _chain(gm)
    assert len(sites) == 4 and sites[-1].readers == ()
    (read,) = [n for n in gm.graph.nodes if str(n.target) == SPLIT_READ and len(n.args[0]) == 1]
    assert read.args[2] == 3  # the last site's norm, read through the copy
    assert [str(u.target) for u in read.users] == ["<built-in function getitem>"]


@pytest.mark.parametrize("fn,rows,flags,chained", [
    (two_layers, 512 * 2, {"matmul_prologue": False}, 0),  # no matmul in the sites
    (two_layers, 512 * 2, {"row_split": False}, 0),  # chains off
    (two_layers, 256 * 2, {}, 0),           # under MIN_ROWS: the sites stay as they are
    (residual_read_twice, 512 * 2, {}, 2),  # the chain starts after the residual read
    (norm_read_by_no_gemm, 512 * 2, {}, 2),  # ... after the norm a sum reads
])
def test_a_chain_only_where_its_conditions_hold(fn, rows, flags, chained):
    x = rand(2, rows // 2, D)
    args = (x, rand(40, D, seed=20)) if fn is two_layers else (x,)
    gm = export(fn, *args, *_weights())
    fuse(gm, **{"matmul_prologue": True, **flags})
    targets = _targets(gm)
    assert targets.count(SPLIT_SITE) == chained and targets.count(SPLIT_READ) == chained
    assert targets.count("infini_dist.fused_site.default") == 4 - chained
    if chained:  # the last two sites: their first residual is a whole site's output
        (site,) = [n for n in gm.graph.nodes if str(n.target) == SPLIT_SITE and n.args[2] == 0]
        assert str(site.args[0][2].args[0].target) == "infini_dist.fused_site.default"


def test_the_split_counts_its_buffers_before_it_takes_them():
    """Two sets, whatever the sites (sites k and k + 2 share one): the symmetric scatter and
    gather buffers (size classes), the residual and the peers' parts; a chain whose buffers
    would take too much of a GPU runs site by site."""
    from infini_dist.scheduler.split_chain import ChainRunner, ChainSite, chain_text
    site = ChainSite("{}", 2048, 2048, 4096, True, 1e-6, True, ((6144, True, False),))
    runner = ChainRunner(chain_text("g0", torch.bfloat16, [site] * 64), None)
    per_site = 2 * 16 * 2**20 + 16 * 2**20 + 8 * 2**20  # 2048 x 4096 bf16 at 2 ranks
    assert runner.buffer_bytes(2) == 2 * per_site  # Llama-3-8B's 32 layers: 112 MiB
    assert runner.buffer_bytes(4) == 2 * (per_site + 4 * 2**20)
    one = ChainRunner(chain_text("g0", torch.bfloat16, [site]), None)
    assert one.buffer_bytes(2) == per_site
    assert runner._unsupported(torch.device("cpu"), 2) == "not on CUDA"


def test_the_flag_is_on_by_default_validated_and_in_the_pass_uuid():
    from infini_dist.compile import FUSION_PASS
    assert infini_dist.config.row_split is True
    with pytest.raises(TypeError, match="row_split"):
        infini_dist.config.row_split = "no"
    before = FUSION_PASS.uuid()
    with infini_dist.config.patch(row_split=False):
        assert FUSION_PASS.uuid() != before


def test_a_chain_committed_to_the_split_keeps_its_sites_when_the_graph_compiles_again():
    """A site of a split chain is written as a site again, whatever it decided alone, so that
    the chain forms again (compile/decided.py); other sites and other rows are unaffected."""
    from infini_dist.compile import decided
    from infini_dist.scheduler.store import STORE
    x, lm = rand(2, 512, D), rand(40, D, seed=20)
    gm = export(two_layers, x, lm, *_weights())
    fuse(gm, matmul_prologue=True)
    _, _, sites = _chain(gm)
    node = next(n for n in gm.graph.nodes if str(n.target) == SPLIT_SITE)
    inputs = node.args[0]
    settings = infini_dist.config.snapshot()
    owned = decided._split_owned(sites[0].site, inputs)
    STORE.split_sites.add((sites[0].site, 1024))
    try:
        assert not owned and decided._split_owned(sites[0].site, inputs)
        assert decided.written([(sites[0].site, inputs)], settings) == (0, False)
        assert not decided._split_owned(sites[-1].site, inputs)  # another site's text
        STORE.split_sites = {(sites[0].site, 2048)}
        assert not decided._split_owned(sites[0].site, inputs)  # other rows
    finally:
        STORE.split_sites = set()


# ---- HF Llama, transformers' TP on gloo ----------------------------------------------------------

def llama_rank(rank, world, path):
    from transformers import AutoModelForCausalLM

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.launch.bench_hf import tp_load_kwargs
    from infini_dist.scheduler.split_chain import chain_decisions, parse_chain
    _one_compile_thread()
    os.environ["WORLD_SIZE"] = str(world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 **tp_load_kwargs()).eval()
    ids = torch.randint(0, 128, (2, 512), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        with infini_dist.config.patch(matmul_prologue=True), idc.recording() as graphs:
            ours = idc.compile_model(model, recompile_decided=False)(input_ids=ids).logits
    local = [t.to_local() if hasattr(t, "to_local") else t for t in (eager, ours)]
    return {"eager": local[0], "ours": local[1],
            "chains": [len(parse_chain(t)[2]) for g in graphs for t in g.chains],
            "decisions": chain_decisions()}


def test_hf_llama_prefill_compiles_into_one_chain_on_gloo(tmp_path):
    pytest.importorskip("transformers")
    path = save_llama(str(tmp_path / "llama"), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=128, max_position_embeddings=1024)
    results = run_ranks(llama_rank, 2, path, env=_env(), timeout=400)
    for r in results:
        assert r["chains"] == [4], r["chains"]  # o_proj and down of each layer
        (decision,) = r["decisions"]
        assert decision["mode"] == "sites" and decision["reason"] == "not on CUDA"
        scale = float(r["eager"].abs().max())
        assert float((r["ours"] - r["eager"]).abs().max()) <= 1e-4 * (1 + scale)
    assert torch.equal(results[0]["ours"], results[1]["ours"])


def _one_rank_cannot_split(rank, world):
    import torch.distributed as dist

    from infini_dist.scheduler.split_chain import ChainRunner, ChainSite, chain_text
    site = ChainSite("{}", 64, 16, 16, True, 1e-6, True, ((32, True, False),))
    with infini_dist.config.patch(tuning_timeout_s=30.0):
        runner = ChainRunner(chain_text(dist.group.WORLD.group_name, torch.float32,
                                        [site, site]), infini_dist.config.snapshot())
    # rank 1 could split (as on a GPU), rank 0 cannot: rank 1 must not go on to time alone
    runner._unsupported = lambda device, world: None if rank else "no libcuda"
    runner._decide([torch.ones(64, 16)])
    return runner.mode, runner.decision


def test_a_rank_that_cannot_split_takes_every_rank_site_by_site():
    results = run_ranks(_one_rank_cannot_split, 2, timeout=120)
    assert results == [("sites", {"mode": "sites", "reason": "no libcuda"})] * 2


def _decide_three_times(rank, world):
    import types

    import torch.distributed as dist

    from infini_dist.scheduler import lockstep, split_ways
    from infini_dist.scheduler.split_chain import ChainRunner, ChainSite, chain_text
    from infini_dist.scheduler.store import STORE
    site = ChainSite("{}", 64, 16, 16, True, 1e-6, True, ((32, True, False), (32, True, False)))
    last = ChainSite("{}", 64, 32, 16, True, 1e-6, False, ((48, True, False),))
    text = chain_text(dist.group.WORLD.group_name, torch.float32, [site, last, site, last])
    timed = []

    def worst_medians(settings, choices, values, ctx, plane):  # the split cut by columns wins
        timed.append([c.name for c in choices])
        return {c.name: {"sites": 3.0, "split_cols": 1.0}.get(c.name, 2.0) for c in choices}
    # What needs a GPU (the buffers, the runs, the timing) is stood in for; the rest is real.
    lockstep.worst_medians = worst_medians
    split_ways.Ways.first_run = lambda self: None
    ChainRunner._build = lambda self, group, device, plane: setattr(
        self, "split", [types.SimpleNamespace(parted=None, columns=1) for _ in self.sites])
    ChainRunner._unsupported = lambda self, device, world: None

    def decide():
        runner = ChainRunner(text, infini_dist.config.snapshot())
        runner._decide([torch.ones(64, 16)])
        return runner, (runner.mode, runner.decision.get("source"),
                        [(s.parted, s.columns) for s in runner.split], len(timed))
    runner, first = decide()
    STORE.records.clear()  # as a new process: only the disk has the decision
    _, second = decide()
    # rank 0's record on disk (the one every rank takes) names a way the chain does not offer
    # at its second site: every rank must time again, not raise or trust it
    key, cache_dir = runner._cache_key(world, torch.device("cpu")), runner.settings.cache_dir
    if rank == 0:
        record = STORE.records.read_disk(cache_dir, key)
        record["units"][1]["split"] = "split_first"  # one reader there: no _first way
        STORE.records.write_disk(cache_dir, key, record)
    STORE.records.clear()
    _, bad = decide()
    with infini_dist.config.patch(fusion_speedup_threshold=1.5):  # a flag the key holds
        _, third = decide()
    return first, second, bad, third


def test_a_chains_decision_is_cached_on_disk_and_agreed():
    """The first process times (two distinct sites), a later one takes rank 0's record from
    disk with each site's way, untimed; a record that does not fit the chain is timed again;
    other decision flags time again."""
    results = run_ranks(_decide_three_times, 2, timeout=120)
    cols = [(None, 2)] * 4
    assert results == [(("split", None, cols, 2), ("split", "cache", cols, 2),
                        ("split", None, cols, 4), ("split", None, cols, 6))] * 2
