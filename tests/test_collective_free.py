"""The collective-free compile (launch/collective_free.py), the floor of `bench --hf` and
`bench --model`, on 2 gloo ranks: every functional collective becomes a local stand-in of its
shape, nothing is sent (the profiler sees no c10d call at run time), and a plain compile of the
same function in the same process, compiled after it, still communicates.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from multirank import run_ranks


def _tp_like(x, w, group):
    """A row-parallel matmul's all_reduce, an all_gather of its output, a reduce_scatter back."""
    y = funcol.all_reduce(x @ w, "sum", group)
    z = funcol.all_gather_tensor(torch.relu(y), 0, group)
    return y, z, funcol.reduce_scatter_tensor(z * 2, "sum", 0, group)


def _max(x, group):
    """Not a sum: the pass's matcher declines it, so it stays and is counted as left."""
    return funcol.all_reduce(x + 1, "max", group)


def _c10d_calls(fn) -> list[str]:
    """The c10d / functional-collective ops one call of fn dispatched (host view)."""
    from torch.profiler import profile
    with profile() as prof:
        fn()
    return sorted(e.key for e in prof.key_averages() if "c10d" in e.key or "gloo" in e.key)


def _floor_then_plain(rank, world_size):
    from infini_dist.launch.collective_free import CollectiveFree, compile_model
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own partials
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 6, generator=gen)
    floor = CollectiveFree()
    fns = {"floor": compile_model(lambda a, b: _tp_like(a, b, group), floor, dynamic=False),
           "plain": torch.compile(lambda a, b: _tp_like(a, b, group), dynamic=False),
           "eager": lambda a, b: _tp_like(a, b, group)}
    result = {}
    for name, fn in fns.items():  # the floor compiles first: nothing of it may leak into plain
        outs = [t.clone() for t in fn(x, w)]
        result[name] = (outs, _c10d_calls(lambda f=fn: f(x, w)))
    not_a_floor = CollectiveFree()
    kept = compile_model(lambda a: _max(a, group), not_a_floor, dynamic=False)
    kept(x)
    return result, floor.counts(), not_a_floor.counts(), _c10d_calls(lambda: kept(x)), (x, w)


@pytest.mark.timeout(300)
def test_floor_sends_nothing_and_plain_still_does():
    ranks = run_ranks(_floor_then_plain, 2, timeout=280)
    for rank, (result, counts, kept_counts, kept_calls, (x, w)) in enumerate(ranks):
        assert counts == {"collectives_removed": 3, "collectives_left": 0, "floor_graphs": 1}
        (y, z, r), calls = result["floor"]
        assert calls == []  # at run time: no collective dispatched, nothing sent
        # a collective the pass cannot replace stays, runs, and is counted: no floor then
        assert kept_counts == {"collectives_removed": 0, "collectives_left": 1,
                               "floor_graphs": 1}
        assert "gloo:all_reduce" in kept_calls, kept_calls
        # the stand-ins: the rank's own partials, its shard repeated, a slice of its own rows
        local = x @ w
        torch.testing.assert_close(y, local)
        torch.testing.assert_close(z, torch.cat([torch.relu(local)] * 2))
        torch.testing.assert_close(r, (2 * torch.cat([torch.relu(local)] * 2))[:4])

        plain, plain_calls = result["plain"]
        eager, _ = result["eager"]
        assert any("all_gather" in c for c in plain_calls), plain_calls
        assert any("reduce_scatter" in c for c in plain_calls), plain_calls
        for got, want in zip(plain, eager):
            torch.testing.assert_close(got, want)
        others = ranks[1 - rank][-1]
        total = x @ w + others[0] @ others[1]
        torch.testing.assert_close(eager[0], total)
        assert not torch.allclose(y, total, atol=1e-3)  # the floor really skipped the sum
