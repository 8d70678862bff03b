"""Cross-rank agreement: timing noise, injected failures, wrong answers, world sizes 2, 3 and 6."""

import random

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks


def ar_block_graph():
    from infini_dist.scheduler.ir import OpNode, SubGraph
    return SubGraph((OpNode("scale", ("x",), ("xs",), {"scale": 0.5}),
                     OpNode("all_reduce", ("xs",), ("y",)),
                     OpNode("add_rms_norm", ("y", "res", "w"), ("out", "res_out")),
                     OpNode("relu", ("out",), ("act",))), ("x", "res", "w"), ("act", "res_out"))


def inputs_for(rank, rows=4, hidden=16):
    gen = torch.Generator().manual_seed(100 + rank)
    shared = torch.Generator().manual_seed(7)  # residual and weight are replicated in TP
    return {"x": torch.randn(rows, hidden, generator=gen),
            "res": torch.randn(rows, hidden, generator=shared),
            "w": torch.rand(hidden, generator=shared) + 0.5}


def expected(world_size, rows=4, hidden=16):
    xs = sum(inputs_for(r, rows, hidden)["x"].double() for r in range(world_size)) * 0.5
    ref = inputs_for(0, rows, hidden)
    total = xs + ref["res"].double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * ref["w"].double()
    return torch.relu(normed), total


def noisy_trials(rank, world_size, trials):
    import infini_dist
    from infini_dist.scheduler import engine
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.cache import DECISIONS
    rng = random.Random(1000 * rank + 17)
    local_picks = []

    def noise(medians):
        # Each rank sees its own, wildly different timings: only the MAX consensus can agree.
        noisy = {name: t * rng.uniform(0.2, 5.0) for name, t in medians.items()}
        local_picks.append(min(sorted(noisy), key=noisy.get))
        return noisy

    STORE.timing_hook = noise
    committed = []
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=1, enable_disk_cache=False):
        settings = infini_dist.config.snapshot()
        for _ in range(trials):
            DECISIONS.clear()
            executor = engine.GraphExecutor(ar_block_graph(), settings)
            out = executor.run(inputs_for(rank))
            committed.append(executor.site_runners()[0].last_tuning["choice"])
    act, res = expected(world_size)
    torch.testing.assert_close(out["act"].double(), act, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["res_out"].double(), res, rtol=1e-5, atol=1e-5)
    return committed, local_picks


@pytest.mark.parametrize("world_size,trials", [(2, 50), (3, 50), (6, 8)])
def test_every_rank_commits_the_same_choice_under_noise(world_size, trials):
    results = run_ranks(noisy_trials, world_size, trials, timeout=300)
    committed = [r[0] for r in results]
    assert all(c == committed[0] for c in committed), committed
    assert len(committed[0]) == trials
    # the noise really made ranks disagree locally, so agreement came from the consensus
    local = [r[1] for r in results]
    assert any(len({picks[t] for picks in local}) > 1 for t in range(trials))
    assert len(set(committed[0])) > 1  # and different trials committed different choices


class _FailingAlgorithm:
    """Fails on one rank, in precompile or in run, or returns a wrong answer there."""

    def __init__(self, how, bad_rank):
        from infini_dist.scheduler.torch_fused import TorchFusedAllReduce
        self.inner = TorchFusedAllReduce()
        self.name = f"flaky_{how}"
        self.how = how
        self.bad_rank = bad_rank

    def supports(self, span, meta, ctx):
        return self.inner.supports(span, meta, ctx)

    def compile(self, span, meta, ctx):
        if self.how == "precompile" and ctx.rank == self.bad_rank:
            raise RuntimeError("injected precompile failure")
        run = self.inner.compile(span, meta, ctx)

        def runner(env):
            out = run(env)  # the collective has been entered on every rank by now
            if ctx.rank == self.bad_rank and self.how == "run":
                raise RuntimeError("injected run failure")
            if ctx.rank == self.bad_rank and self.how == "wrong":
                out = {k: v + 1.0 for k, v in out.items()}
            return out
        return runner


def failing_choices(rank, world_size):
    import infini_dist
    from infini_dist.scheduler import engine
    from infini_dist.scheduler.store import STORE
    from infini_dist.scheduler.choices import register_algorithm
    for how in ("precompile", "run", "wrong"):
        register_algorithm("all_reduce", "cpu", _FailingAlgorithm(how, bad_rank=1))
    # make the flaky choices look fastest, so only dropping them keeps them from winning
    STORE.timing_hook = lambda m: {n: (1e-9 if n.startswith("flaky") else t) for n, t in
                                    m.items()}
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=1):
        executor = engine.executor_for(ar_block_graph(), infini_dist.config.snapshot())
        out = executor.run(inputs_for(rank))
    record = executor.site_runners()[0].last_tuning
    act, _ = expected(world_size)
    torch.testing.assert_close(out["act"].double(), act, rtol=1e-5, atol=1e-5)
    return record["choice"], record["candidates"]


def test_a_failure_on_one_rank_drops_the_choice_everywhere():
    (c0, cands0), (c1, cands1) = run_ranks(failing_choices, 2, timeout=180)
    assert c0 == c1 and cands0 == cands1
    assert not any(name.startswith("flaky") for name in cands0), cands0
    assert "native" in cands0 and any(n.startswith("torch_fused") for n in cands0)


class _RacyAlgorithm:
    """Its compile fails while another compile of the same kind runs beside it, as a library
    with a thread-unsafe compile step would."""

    def __init__(self, name, state):
        from infini_dist.scheduler.torch_fused import TorchFusedAllReduce
        self.inner, self.name, self.state = TorchFusedAllReduce(), name, state

    def supports(self, span, meta, ctx):
        return self.inner.supports(span, meta, ctx)

    def compile(self, span, meta, ctx):
        import time
        with self.state["lock"]:
            self.state["running"] += 1
            self.state["calls"] += 1
        try:
            time.sleep(0.2)  # long enough that the pool's other threads overlap it
            with self.state["lock"]:
                if self.state["running"] > 1:
                    raise RuntimeError("compiled beside another one")
        finally:
            with self.state["lock"]:
                self.state["running"] -= 1
        return self.inner.compile(span, meta, ctx)


def racy_compiles(rank, world_size):
    import threading

    import infini_dist
    from infini_dist.scheduler import engine
    from infini_dist.scheduler.choices import register_algorithm
    state = {"lock": threading.Lock(), "running": 0, "calls": 0}
    for name in ("racy_a", "racy_b", "racy_c"):
        register_algorithm("all_reduce", "cpu", _RacyAlgorithm(name, state))
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=1, max_autotune_threads=4):
        executor = engine.executor_for(ar_block_graph(), infini_dist.config.snapshot())
        executor.run(inputs_for(rank))
    return executor.site_runners()[0].last_tuning["candidates"], state["calls"]


def test_a_choice_that_fails_only_beside_others_survives():
    for candidates, calls in run_ranks(racy_compiles, 2, timeout=180):
        racy = [c for c in candidates if c.startswith("racy")]
        # Every depth of all three algorithms is a candidate, after a lone retry of those
        # that failed in the pool (more compile calls than choices).
        assert {c.split("[")[0] for c in racy} == {"racy_a", "racy_b", "racy_c"}, candidates
        assert calls > len(racy), (calls, racy)


def absent_peer(rank, world_size):
    import infini_dist
    from infini_dist.scheduler.control import ControlPlaneError
    from infini_dist.scheduler.engine import executor_for
    with infini_dist.config.patch(tuning_timeout_s=3.0):
        if rank == 1:
            # rank 1 never tunes: rank 0 must get a clear error, not a hang
            dist.barrier()
            return "skipped"
        try:
            executor_for(ar_block_graph(), infini_dist.config.snapshot()).run(inputs_for(rank))
        except ControlPlaneError as error:
            dist.barrier()
            return str(error)
        return "no error"


def test_a_rank_that_never_arrives_gives_a_clear_error_in_time():
    message, skipped = run_ranks(absent_peer, 2, timeout=120)
    assert skipped == "skipped"
    assert "did not arrive" in message and "rank 0" in message, message
