"""compile/reshape_first.py: a reshape between an all_reduce and its epilogue moves ahead of the
all_reduce, so the epilogue joins the site (the MoE blocks' spelling). The HF MoE families in
test_hf_families.py check the numerics on two ranks; here, which graphs move and which do not."""

from __future__ import annotations

import torch

from infini_dist.compile.reshape_first import reshape_first
from fx_graphs import FUSED, ar, assert_unchanged, c10d, export, fuse, ops_of, rand
from multirank import run_ranks

def _moe(x, shared, residual, w, reduce=ar):
    # experts' [tokens, H] partial sums reduced, a replicated expert added, [b, s, H] restored
    out = (reduce(x) + shared).view(residual.shape) + residual
    # eps written here: under dynamic=True Dynamo makes a float default argument a graph input
    return torch.nn.functional.rms_norm(out, out.shape[-1:], w, 1e-6), out


def _moe_args():
    return rand(4, 16), rand(4, 16, seed=1), rand(2, 2, 16, seed=2), rand(16, seed=3)


def _all_reduce_input(gm):
    (node,) = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    return node.args[0]


def test_the_reshape_moves_ahead_of_the_all_reduce_and_the_ops_between():
    gm = export(_moe, *_moe_args())
    assert reshape_first(gm.graph) == 1
    gm.graph.lint()
    reshaped = _all_reduce_input(gm)
    assert reshaped.target is torch.ops.aten.reshape.default
    assert tuple(reshaped.meta["val"].shape) == (2, 2, 16)
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert [tuple(a.meta["val"].shape) for a in add.args] == [(2, 2, 16)] * 2
    assert tuple(add.meta["val"].shape) == (2, 2, 16)
    # no view is left between the all_reduce's wait and the residual add
    wait = next(n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default)
    assert tuple(wait.meta["val"].shape) == (2, 2, 16)
    assert [u.target for u in wait.users] == [torch.ops.aten.add.Tensor]


def test_the_moe_block_becomes_one_site_with_its_residual_norm():
    gm = export(_moe, *_moe_args())
    (sub,) = fuse(gm)
    assert ops_of(sub) == ["all_reduce", "add", "add_rms_norm"]
    (site,) = [n for n in gm.graph.nodes if n.target is FUSED]
    assert [tuple(a.meta["val"].shape) for a in site.args[0]][:2] == [(2, 2, 16)] * 2


def test_a_reshape_that_changes_the_row_length_stays():
    assert_unchanged(reshape_first, lambda x: ar(x).view(4, 4, 4) * 2.0, rand(4, 16))


def test_an_all_reduce_read_beside_the_reshape_stays():
    def f(x):
        h = ar(x)
        return h.view(2, 2, 16) * 2.0, h
    assert_unchanged(reshape_first, f, rand(4, 16))


def test_a_broadcast_operand_on_the_way_stays():
    # a per-token gate [tokens, 1] would need its own reshape rule: not moved
    assert_unchanged(reshape_first, lambda x, g: (ar(x) * g).view(2, 2, 16), rand(4, 16),
                     rand(4, 1, seed=1))


def test_an_op_that_is_not_pointwise_on_the_way_stays():
    assert_unchanged(reshape_first, lambda x: torch.cumsum(ar(x), 0).view(2, 2, 16), rand(4, 16))


def test_the_moved_graph_computes_what_the_graph_did(one_rank):
    def f(x, shared, residual, w):
        return _moe(x, shared, residual, w,
                    lambda p: c10d.wait_tensor(c10d.all_reduce(p, "sum", one_rank)))
    args = _moe_args()
    gm = export(f, *args)
    assert reshape_first(gm.graph) == 1
    gm.recompile()
    for got, want in zip(gm(*args), f(*args)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def dynamic_rank(rank, world_size):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import infini_dist.compile as idc
    group = dist.group.WORLD.group_name

    def block(x, shared, residual, w):
        return _moe(x, shared, residual, w,
                    lambda p: funcol.wait_tensor(funcol.all_reduce(p, "sum", group)))
    errors = []
    with idc.recording() as graphs:
        compiled = torch.compile(block, options=idc.inductor_options(), dynamic=True)
        for tokens in (4, 6):  # every rank the same inputs: the sum is world_size times each
            args = (rand(2 * tokens, 16), rand(2 * tokens, 16, seed=1),
                    rand(2, tokens, 16, seed=2), rand(16, seed=3))
            want = _moe(*args, lambda p: p * world_size)
            errors += [float((g - w).abs().max()) for g, w in zip(compiled(*args), want)]
    return {"errors": errors, "sites": [g.site_ops() for g in graphs]}


def test_a_dynamic_token_count_moves_too():
    # A server's compile: the token count symbolic, the view's sizes read from the residual.
    for r in run_ranks(dynamic_rank, 2, timeout=300):
        assert r["sites"] == [[["all_reduce", "add", "add_rms_norm"]]]
        assert max(r["errors"]) < 1e-5


def test_a_strided_operand_stays():
    # reshaped, a transposed input would be copied: one more pass over memory than the view
    assert_unchanged(reshape_first, lambda x: ar(x.t()).view(2, 2, 16), rand(16, 4))
    assert_unchanged(reshape_first, lambda x, s: (ar(x) + s.t()).view(2, 2, 16), rand(4, 16),
                     rand(16, 4, seed=1))
