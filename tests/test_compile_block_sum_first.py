"""compile/block_sum_first.py: a sum over dims of an all_reduce's result moves ahead of it, so the
all_reduce sends the summed bytes. transformers' Llama 4 all_reduces its experts' [E * T, H]
outputs, then sums the E blocks; after the move its MoE block is one site with the shared
expert's all_reduce, the residual add and the next norm. test_hf_families.py runs Llama 4
itself; here, which graphs move, and the numerics against fp64 on two ranks in bf16."""

from __future__ import annotations

import torch

from infini_dist.compile.block_sum_first import block_sum_first
from fx_graphs import ar, assert_unchanged, c10d, export, fuse, ops_of, rand
from multirank import run_ranks

EXPERTS, TOKENS, HIDDEN = 4, 6, 16


def _llama4_moe(routed, shared, residual, w, reduce=ar):
    # every token through every expert: [E * T, H] partials, reduced, summed over the experts
    out = reduce(routed).view(EXPERTS, -1, HIDDEN).sum(0) + reduce(shared)
    out = out.view(residual.shape) + residual
    return torch.nn.functional.rms_norm(out, out.shape[-1:], w, 1e-6), out


def _args(dtype=torch.float32, seed=0):
    return (rand(EXPERTS * TOKENS, HIDDEN, dtype=dtype, seed=seed),
            rand(TOKENS, HIDDEN, dtype=dtype, seed=seed + 1),
            rand(2, TOKENS // 2, HIDDEN, dtype=dtype, seed=99), rand(HIDDEN, dtype=dtype, seed=98))


def _reduced_shapes(gm):
    return [tuple(n.args[0].meta["val"].shape) for n in gm.graph.nodes
            if n.target is c10d.all_reduce.default]


def test_the_sum_moves_ahead_and_the_block_becomes_one_site():
    gm = export(_llama4_moe, *_args())
    assert _reduced_shapes(gm) == [(EXPERTS * TOKENS, HIDDEN), (TOKENS, HIDDEN)]
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "all_reduce", "add", "add_rms_norm"]


def test_without_a_view_and_over_another_dim_it_moves_too():
    gm = export(lambda x: ar(x).sum(1), rand(EXPERTS, TOKENS, HIDDEN))
    assert block_sum_first(gm.graph) == 1
    gm.graph.lint()
    assert _reduced_shapes(gm) == [(EXPERTS, HIDDEN)]


def test_a_sum_to_another_dtype_stays():
    # the all_reduce would carry fp32 where it carried bf16
    assert_unchanged(block_sum_first,
                     lambda x: ar(x).view(EXPERTS, -1, HIDDEN).sum(0, dtype=torch.float32),
                     rand(EXPERTS * TOKENS, HIDDEN, dtype=torch.bfloat16))


def test_a_result_read_beside_the_sum_stays():
    def f(x):
        reduced = ar(x)
        return reduced.view(EXPERTS, -1, HIDDEN).sum(0), reduced
    assert_unchanged(block_sum_first, f, rand(EXPERTS * TOKENS, HIDDEN))


def test_a_mean_stays():
    assert_unchanged(block_sum_first, lambda x: ar(x).view(EXPERTS, -1, HIDDEN).mean(0),
                     rand(EXPERTS * TOKENS, HIDDEN))


def test_the_moved_graph_computes_what_the_graph_did(one_rank):
    def f(*args):
        return _llama4_moe(*args, reduce=lambda p: c10d.wait_tensor(
            c10d.all_reduce(p, "sum", one_rank)))
    args = _args()
    gm = export(f, *args)
    assert block_sum_first(gm.graph) == 1
    gm.recompile()
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # one rank: the same sums


def bf16_rank(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import infini_dist.compile as idc
    group = dist.group.WORLD.group_name

    def block(*args):
        return _llama4_moe(*args, reduce=lambda p: funcol.wait_tensor(
            funcol.all_reduce(p, "sum", group)))
    ranks = [_args(torch.bfloat16, seed=10 * r) for r in range(world)]  # every rank's inputs
    mine = ranks[rank]
    # fp64: the partials summed over ranks and experts, the rest as the block does
    routed = sum(r[0].double() for r in ranks).view(EXPERTS, -1, HIDDEN).sum(0)
    out = (routed + sum(r[1].double() for r in ranks)).view(mine[2].shape) + mine[2].double()
    want = torch.nn.functional.rms_norm(out, out.shape[-1:], mine[3].double(), 1e-6)
    with torch.no_grad(), idc.recording() as graphs:
        moved = idc.compile_model(block, backend="infini_dist")(*mine)[0]
    unmoved = block(*mine)[0]

    def error(t):
        return float((t.double() - want).abs().max() / want.abs().max())
    return {"moved": error(moved), "unmoved": error(unmoved), "out": moved,
            "sites": [g.site_ops() for g in graphs]}


def test_in_bf16_on_two_ranks_the_moved_sum_is_as_close_to_fp64():
    from test_compile_tp import _env
    results = run_ranks(bf16_rank, 2, env=_env(), timeout=300)
    for r in results:
        assert r["sites"] == [[["all_reduce", "all_reduce", "add", "add_rms_norm"]]]
        assert r["moved"] <= 2e-2 and r["moved"] <= 2 * r["unmoved"] + 4e-3, r
    assert torch.equal(results[0]["out"], results[1]["out"])
