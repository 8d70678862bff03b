"""compile_model compiles again by itself once its sites decide (compile/recompile.py): no
torch._dynamo.reset(), no second compile_model. 2 gloo ranks; the timing hook makes native win,
so the site goes whole -> Inductor's own code, as in test_compile_decided, over calls of one
compiled function or module. Where our bare all_reduce wins, the site goes whole -> its
all_reduce alone, and that decision compiles nothing more."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from multirank import run_ranks
from test_compile_decided import _bare_algorithm, _bare_fastest
from test_compile_tp import _ar, _one_compile_thread
from test_native import EPS, _slow_fused


class Block(torch.nn.Module):
    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.weight = torch.nn.Parameter(torch.rand(32, generator=torch.Generator().manual_seed(3))
                                         + 0.5)

    def forward(self, x, residual):
        h = _ar(x, self.group_name) + residual
        return F.rms_norm(h, (32,), self.weight, EPS), h


def recompile_rank(rank, world_size):
    import torch.distributed as dist

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.scheduler.choices import register_algorithm
    from infini_dist.scheduler.store import STORE

    _one_compile_thread()
    group = dist.group.WORLD.group_name
    module = Block(group)

    def block(x, residual, weight):
        h = _ar(x, group) + residual
        return F.rms_norm(h, (32,), weight, EPS), h

    def bare_block(x, residual, weight):  # a code object of its own: none of block's entries
        h = _ar(x, group) + residual
        return F.rms_norm(h, (32,), weight, EPS), h

    def inputs(rows):  # each scenario its own token bucket, decided afresh
        own, shared = (torch.Generator().manual_seed(s) for s in (10 + rank, 7))
        return torch.randn(rows, 32, generator=own), torch.randn(rows, 32, generator=shared)

    def calls(compiled, args, eager, n=5):
        """Per call: (sites the pass replaced, sites left to Inductor) in compiles it made,
        and whether the outputs match eager."""
        rows = []
        for _ in range(n):
            sites, native = idc.stats["sites"], idc.stats["native_sites"]
            out = compiled(*args)
            rows.append((idc.stats["sites"] - sites, idc.stats["native_sites"] - native,
                         all(torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                             for a, b in zip(out, eager))))
        return rows

    result = {}
    try:
        with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=2):
            STORE.timing_hook = _slow_fused
            torch._dynamo.reset()
            x, residual = inputs(4)
            weight = module.weight.detach().clone()
            fn = idc.compile_model(block)
            result["function"] = calls(fn, (x, residual, weight), block(x, residual, weight))
            result["function_recompiles"] = idc.recompiles(fn)
            x, residual = inputs(8)
            compiled = idc.compile_model(module)
            with torch.no_grad():
                result["module"] = calls(compiled, (x, residual), module(x, residual))
            result["module_recompiles"] = idc.recompiles(compiled)
            result["module_is_a_module"] = (isinstance(compiled, torch.nn.Module)
                                            and compiled.weight is module.weight)
            x, residual = inputs(16)
            plain = idc.compile_model(block, recompile_decided=False)
            result["off"] = calls(plain, (x, residual, weight), block(x, residual, weight), n=3)
            register_algorithm("all_reduce", "cpu", _bare_algorithm())
            STORE.timing_hook = _bare_fastest
            x, residual = inputs(32)
            fn = idc.compile_model(bare_block)
            result["bare"] = calls(fn, (x, residual, weight), block(x, residual, weight), n=4)
            result["bare_recompiles"] = idc.recompiles(fn)
    finally:
        STORE.timing_hook = None
    return result


def test_compile_model_recompiles_once_sites_decide():
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    for r in run_ranks(recompile_rank, 2, env=env, timeout=400):
        # call 1 compiles the whole site; it decides native, against our all_reduce alone
        # too. Call 2 compiles again: Inductor's code only. Then nothing compiles any more.
        expected = [(1, 0, True), (0, 1, True), (0, 0, True), (0, 0, True), (0, 0, True)]
        assert r["function"] == expected, r["function"]
        assert r["module"] == expected, r["module"]
        assert r["function_recompiles"] == 1 and r["module_recompiles"] == 1
        assert r["module_is_a_module"]
        # recompile_decided=False: the first compile stays, its site through our op
        assert r["off"] == [(1, 0, True), (0, 0, True), (0, 0, True)], r["off"]
        # ours wins: call 2 compiles the all_reduce alone, which decides ours; written the same
        # again, it is no reason to compile a third time
        assert r["bare"] == [(1, 0, True), (1, 0, True), (0, 0, True), (0, 0, True)], r["bare"]
        assert r["bare_recompiles"] == 1
