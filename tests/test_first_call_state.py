"""What a site's first call leaves behind holds no tensor of any call, and is made off the
caller's thread (scheduler/setup_thread.py says why: CUDA-graph trees route every allocation of
the calling thread to their pool during a warm-up, and report whatever outlives it there).

- The engine on 2 gloo ranks: tuning and the first run of the committed choice happen on another
  thread than the caller's; after the calls, no input, output or intermediate of any call
  (tuning's references and trial outputs included) is alive, while the committed choices are.
- The cached launchers (backends.symm_launch.PreparedLaunch and its nt_runtime.FastLaunch, the
  ninetoothed chain launch of nccl+nt_epilogue) keep no tensor of their calls, on Triton's real
  launch path (a stand-in driver, tests/launch_stub.py), after taking the fast path.
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch

from multirank import run_ranks


def _engine_rank(rank, world_size):
    import infini_dist
    from infini_dist import ops
    from infini_dist.scheduler import engine
    from infini_dist.scheduler.store import STORE

    threads = []
    tune = engine.SiteRunner._tune

    def recording_tune(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return tune(self, *args, **kwargs)

    engine.SiteRunner._tune = recording_tune
    refs = []
    try:
        with infini_dist.config.patch(benchmark_warmup=1, benchmark_reps=2):
            for call in range(3):  # the first tunes, the others run the committed choices
                g = torch.Generator().manual_seed(call * 10 + rank)
                x, residual = torch.randn(4, 32, generator=g), torch.randn(4, 32)
                weight = torch.rand(32) + 0.5
                out, res_out = ops.all_reduce_add_rms_norm(x, residual, weight)
                act = ops.all_reduce_relu_scale(x, 0.5)
                expected = torch.relu(res_out - residual) * 0.5  # relu(sum of x) * 0.5
                assert torch.allclose(act, expected, atol=1e-5), (act - expected).abs().max()
                refs += [weakref.ref(t) for t in (x, residual, weight, out, res_out, act)]
                del x, residual, weight, out, res_out, act, expected
    finally:
        engine.SiteRunner._tune = tune
    gc.collect()
    used = [STORE.entries[name].executor for name in ops.OP_NAMES]
    committed = [runner._committed for executor in used if executor is not None
                 for runner in executor.site_runners()]
    return {"caller": threading.get_ident(), "tuned_on": threads,
            "alive": sum(r() is not None for r in refs), "refs": len(refs),
            "committed": [len(c) for c in committed]}


def test_engine_decides_off_the_callers_thread_and_keeps_no_call_tensor():
    for result in run_ranks(_engine_rank, 2, timeout=240):
        assert result["committed"] == [1, 1], result
        assert len(result["tuned_on"]) == 2, result  # one decision per op, not per call
        assert result["caller"] not in result["tuned_on"], result
        assert result["refs"] == 18 and result["alive"] == 0, result


# ---- the cached launchers, on Triton's real launch path ------------------------------------------

def _alive_after(calls, make_env, launcher_call) -> tuple[int, int]:
    """(tensors of `calls` calls still alive once the caller dropped them, tensors tracked)."""
    refs = []
    for call in range(calls):
        env = make_env(call)
        outputs = launcher_call(env)
        refs += [weakref.ref(t) for t in list(env.values()) + list(outputs)]
        del env, outputs
    gc.collect()
    return sum(r() is not None for r in refs), len(refs)


def _stub_kept_tensors():
    """In the stub-driver process (launches record nothing). Returns (what, alive, tracked, fast)."""
    import torch.distributed as dist
    from infini_dist.kernels.elementwise_chain import prepare
    from infini_dist.scheduler.backends.nccl_epilogue import NcclEpilogueAlgorithm
    from infini_dist.scheduler.backends.symm_launch import PreparedLaunch
    from infini_dist.scheduler.choices import RunContext
    from symm_cases import make_inputs
    from launch_stub import SYMM_CASES, chain_cases, chain_inputs, stub_symm_case
    from test_nccl_epilogue_cpu import span_and_meta, tensors_for

    report = []
    world_size, rank = 4, 1
    for kind, pattern, shape, dtype in SYMM_CASES:
        algorithm, graph, plan, buffer = stub_symm_case(kind, pattern, shape, dtype,
                                                         world_size, rank)
        first = make_inputs(graph, shape, dtype, rank, 0)
        prepared = PreparedLaunch(algorithm, plan, buffer, first)
        first_refs = [weakref.ref(t) for t in first.values()]
        del first
        alive, tracked = _alive_after(
            4, lambda call: make_inputs(graph, shape, dtype, rank, call + 1),
            lambda env: prepared(env).values())
        alive += sum(r() is not None for r in first_refs)
        report.append((f"PreparedLaunch {kind} {pattern}", alive, tracked + len(first_refs),
                       prepared.launch.fast))

    for chain, shapes, dtype in chain_cases():
        launch = prepare(chain, shapes, [dtype] * len(shapes))
        alive, tracked = _alive_after(
            4, lambda call: dict(enumerate(chain_inputs(shapes, dtype, call))),
            lambda env: launch(list(env.values())))
        fast = launch.state["fast"]
        report.append((f"chain {chain.steps[0].op}", alive, tracked, bool(fast) and fast.fast))

    saved, dist.all_reduce = dist.all_reduce, lambda tensor, group=None: None
    try:
        ctx = RunContext(None, world_size, rank, torch.device("cpu"))
        span, meta = span_and_meta("add_rms_norm", (2, 64), torch.bfloat16,
                                   device=torch.device("cpu"))
        run = NcclEpilogueAlgorithm().compile(span, meta, ctx)
        alive, tracked = _alive_after(
            4, lambda call: {n: t.to(meta[n].dtype) for n, t in
                             tensors_for("add_rms_norm", (2, 64), torch.bfloat16,
                                         seed=call).items()},
            lambda env: run(env).values())
        report.append(("nccl+nt_epilogue add_rms_norm", alive, tracked, None))
    finally:
        dist.all_reduce = saved
    return report


def test_cached_launchers_keep_no_tensor_of_their_calls(tmp_path):
    from interpreter_worker import run as run_in_pool
    from launch_stub import chain_cases, stub_pool
    with stub_pool(str(tmp_path / "home"), record=False) as pool:
        report = run_in_pool(pool, _stub_kept_tensors)
    assert len(report) == 4 + len(chain_cases()) + 1, report
    for what, alive, tracked, fast in report:
        assert tracked > 0 and alive == 0, (what, alive, tracked)
        assert fast in (True, None), (what, "the fast path was not exercised")
