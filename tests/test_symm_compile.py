"""Every symmetric-memory kernel through the GPU compiler on the CPU: Triton's CUDA backend
(sm_90, down to a cubin) under a stand-in driver, launching nothing. The interpreter that checks
the kernels' numerics in CI compiles nothing, and device code that only the compiler rejects
reached the GPU once that way (generated jit functions without a __module__ failed every
kernel). Every spec'd chain step and norm is compiled into some kernel, every kernel with a full
prologue, epilogue and norm, every output quantizer (FP8), and every kernel as the engine
launches a training forward site (the norm's rsqrt and the reduced value written too).
"""

from __future__ import annotations

import pytest
import torch

from launch_stub import compile_pool
from symm_runs import symm_algorithms

WORLD = 2


def _steps_and_norms():
    from infini_dist.kernels import symm_call
    from infini_dist.kernels.symm_chain import MAX_CHAIN, STEPS
    steps = sorted(STEPS)
    chains = [tuple(steps[i:i + MAX_CHAIN]) for i in range(0, len(steps), MAX_CHAIN)]
    return chains, sorted(symm_call._NORM_ROLES)


def _step(name, x):
    from infini_dist.kernels.symm_chain import STEPS
    step = STEPS[name]
    if step.scalar is not None:
        return (name, 0.5)
    if step.side is not None:
        return (name, torch.ones(x.shape[-1:] if step.side == "vector" else x.shape,
                                 dtype=x.dtype))
    return (name,)


def _quant(name):
    """The plain callables' `quant` for a quantizer (symm_chain.QUANT_CODES)."""
    from symm_cases import callable_quant
    return callable_quant(name, 0.5)


def compile_kernel(name, prologue, epilogue, norm, residual, dtype, quant=None):
    """In the compile worker: bind one call of `name`'s kernel on a buffer of host tensors and
    compile it (kernel.warmup); returns the compiled kernel's register count."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    kernel = symm_algorithms()[name].kernel
    x = torch.randn(4, 256, dtype=dtype)
    buffer = from_peer_tensors([torch.zeros(header_bytes(WORLD) + (1 << 20), dtype=torch.uint8)
                                for _ in range(WORLD)], 0)
    options = {}
    if norm is not None:
        options = dict(norm=norm, weight=torch.ones(256, dtype=dtype))
        if norm == "layer_norm":
            options["bias"] = torch.zeros(256, dtype=dtype)
        if residual:
            options["residual"] = torch.zeros_like(x)
    jit, grid, args, kwargs, _ = kernel.bind(
        x, buffer=buffer, prologue=[_step(s, x) for s in prologue],
        epilogue=[_step(s, x) for s in epilogue], quant=quant and _quant(quant), **options)
    compiled = jit.warmup(*args, grid=grid, **kwargs)
    return int(compiled.n_regs) if hasattr(compiled, "n_regs") and compiled.n_regs else 0


def compile_planned(name, pattern, dtype):
    """In the compile worker: the engine adapter's launch of symm_cases `pattern` (a site the
    plain callables cannot express, e.g. the training forward's extra outputs), compiled."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    from launch_stub import symm_plan
    from symm_cases import make_inputs
    shape = (4, 256)
    graph, plan = symm_plan(name, pattern, shape, dtype, WORLD, 0)
    assert plan is not None, (name, pattern)
    tensors = {k: v.contiguous() for k, v in make_inputs(graph, shape, dtype, 0, 0).items()}
    buffer = from_peer_tensors([torch.zeros(header_bytes(WORLD) + (1 << 20), dtype=torch.uint8)
                                for _ in range(WORLD)], 0)
    algorithm = symm_algorithms()[name]
    jit, grid, args, kwargs = algorithm.launch_arguments(
        plan, tensors[plan.source], tensors, buffer, plan.allocate(torch.device("cpu")))
    jit.warmup(*args, grid=grid, **kwargs)


def _cases():
    chains, norms = _steps_and_norms()
    names = sorted(symm_algorithms())
    cases = []
    # every kernel once with a full chain on both sides and a norm after a residual
    for i, name in enumerate(names):
        cases.append((name, chains[i % len(chains)], chains[(i + 1) % len(chains)],
                      norms[i % len(norms)], True, torch.bfloat16))
    # every step and every norm somewhere, spread over the kernels
    for i, chain in enumerate(chains):
        cases.append((names[i % len(names)], (), chain, None, False, torch.float32))
    for i, norm in enumerate(norms):
        cases.append((names[(i + 2) % len(names)], (), (), norm, i % 2 == 0, torch.float16))
    # every output quantizer after add + rms_norm in bf16 (the FP8 output beside the residual),
    # and after a plain chain where it needs no row
    from infini_dist.kernels.epilogue import SPECS
    from infini_dist.kernels.symm_chain import QUANT_CODES
    for i, quant in enumerate(sorted(QUANT_CODES)):
        cases.append((names[(i + 3) % len(names)], (), (), "rms_norm", True, torch.bfloat16,
                      quant))
        if not SPECS[quant].symm_quant.row_scale:
            cases.append((names[(i + 4) % len(names)], (), ("silu",), None, False,
                          torch.float32, quant))
    return cases


def test_every_kernel_step_and_norm_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    cases = _cases()
    with compile_pool(str(tmp_path / "home")) as pool:
        futures = [pool.submit(compile_kernel, *case) for case in cases]
        failures = []
        for case, future in zip(cases, futures):
            try:
                future.result(timeout=600)
            except Exception as error:  # every failing case, with the compiler's own cause
                cause = error
                while cause.__cause__ is not None:
                    cause = cause.__cause__
                failures.append(f"{case[:5]}: {type(cause).__name__}: {cause}")
        from symm_cases import TRAIN
        planned = [(name, pattern, torch.bfloat16) for name in sorted(symm_algorithms())
                   for pattern in (TRAIN, "rms_norm+rstd")]
        for case in planned:
            try:
                pool.submit(compile_planned, *case).result(timeout=600)
            except Exception as error:
                cause = error
                while cause.__cause__ is not None:
                    cause = cause.__cause__
                failures.append(f"{case}: {type(cause).__name__}: {cause}")
    assert not failures, "\n".join(failures)
    # the cases cover every registered kernel, chain step and norm
    chains, norms = _steps_and_norms()
    assert {c[0] for c in cases} == set(symm_algorithms())
    assert {s for c in cases for s in c[1] + c[2]} == {s for chain in chains for s in chain}
    assert {c[3] for c in cases} - {None} == set(norms)
    from infini_dist.kernels.symm_chain import QUANT_CODES
    assert {c[6] for c in cases if len(c) > 6} == set(QUANT_CODES)
