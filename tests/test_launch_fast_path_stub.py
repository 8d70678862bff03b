"""The fast launch path on Triton's real (compiling) launch path, on the CPU: a child process
with a stand-in GPU driver (tests/launch_stub.py). The fast path must hand the launcher exactly
what the normal path hands it (same grid, stream and argument list: tensors by address,
everything else by value), take over after the first call, and give the call back to the
normal path whenever Triton would pick another kernel (unaligned or other-dtype tensors,
another device) or the feature is missing or switched off (the fast_launch setting).

`python tests/test_launch_fast_path_stub.py` prints the host cost per call with the launch
stubbed out (a measurement, not a test: timings under CI load prove nothing).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest
import torch

from infini_dist.scheduler.choices import RunContext
from launch_stub import (CURRENT_DEVICE, LAUNCHES, NORMAL_RUNS, SYMM_CASES, chain_cases,
                         chain_inputs, launch_names, stub_pool, stub_symm_case, symm_algorithm,
                         symm_plan, take_launch)
from interpreter_worker import run as run_in_pool
from symm_cases import make_inputs

def _stub_symm_checks():
    """In the stub process. Returns a list of (what, ok, detail)."""
    from infini_dist.kernels import nt_runtime
    from infini_dist.scheduler.backends.symm_launch import PreparedLaunch
    checks = []
    rank = 1
    for kind, pattern, shape, dtype in SYMM_CASES + [("two_shot", "add_rms_norm", (2, 64),
                                                      torch.bfloat16)]:
        what = f"{kind} {pattern} {shape} {dtype}"
        algorithm, graph, plan, buffer = stub_symm_case(kind, pattern, shape, dtype, rank=rank)
        env = make_inputs(graph, shape, dtype, rank, 0)
        got = algorithm.launch(plan, env, buffer)
        normal = take_launch(launch_names(env, got, buffer))
        prepared = PreparedLaunch(algorithm, plan, buffer, env)
        for call in range(3):
            env = make_inputs(graph, shape, dtype, rank, call)
            runs = NORMAL_RUNS[0]
            got = prepared(env)
            fast = take_launch(launch_names(env, got, buffer))
            checks.append((f"{what} call {call}: same launch", fast == normal, (fast, normal)))
            took_fast = NORMAL_RUNS[0] == runs
            checks.append((f"{what} call {call}: fast path from the second call",
                           took_fast == (call > 0) and prepared.launch.fast, took_fast))

        def falls_back(why, env, addresses_known=True):
            runs = NORMAL_RUNS[0]
            got = prepared(env)
            launch = take_launch(launch_names(env, got, buffer))
            checks.append((f"{what} {why}: normal path", NORMAL_RUNS[0] == runs + 1,
                           NORMAL_RUNS[0] - runs))
            if addresses_known:  # else the normal path launched on a contiguous copy
                checks.append((f"{what} {why}: tensors by name",
                               not any("unknown" in str(a) for a in launch[4]), launch[4]))
            checks.append((f"{what} {why}: fast path kept", prepared.launch.fast, None))

        x = env["x"]
        unaligned = torch.empty(x.numel() + 8, dtype=dtype)[1:1 + x.numel()].view(x.shape)
        unaligned.copy_(x)
        falls_back("unaligned x", dict(env, x=unaligned))
        falls_back("strided x", dict(env, x=x.t().contiguous().t()), addresses_known=False)
        falls_back("other dtype x", dict(env, x=x.to(torch.float16 if dtype != torch.float16
                                                    else torch.float32)))
        CURRENT_DEVICE[0] = 1
        try:
            falls_back("other device", env)
        finally:
            CURRENT_DEVICE[0] = 0
        runs = NORMAL_RUNS[0]
        prepared(env)
        LAUNCHES.clear()
        checks.append((f"{what} back to the fast path", NORMAL_RUNS[0] == runs, None))

    # Feature detection: no usable CompiledKernel, or switched off -> the normal path for good.
    kind, pattern, shape, dtype = SYMM_CASES[0]
    for why in ("no CompiledKernel launcher", "fast_launch=False"):
        saved = nt_runtime._compiled_kernel_type
        if why.startswith("no"):
            nt_runtime._compiled_kernel_type = False
        try:
            algorithm, graph, plan, buffer = stub_symm_case(kind, pattern, shape, dtype,
                                                             rank=rank)
            env = make_inputs(graph, shape, dtype, rank, 0)
            normal = take_launch(launch_names(env, algorithm.launch(plan, env, buffer), buffer))
            prepared = PreparedLaunch(algorithm, plan, buffer, env,
                                      fast=why.startswith("no"))
            runs = NORMAL_RUNS[0]
            for _ in range(3):
                got = prepared(env)
                checks.append((f"{why}: same launch",
                               take_launch(launch_names(env, got, buffer)) == normal, None))
            checks.append((f"{why}: normal path every call", NORMAL_RUNS[0] == runs + 3, None))
            checks.append((f"{why}: never fast", not prepared.launch.fast, None))
            if why.startswith("no"):
                checks.append((f"{why}: settled", prepared.launch.normal_only, None))
        finally:
            nt_runtime._compiled_kernel_type = saved
    checks.append(("ninetoothed handle without its kernel: no fast launch",
                   nt_runtime.fast_launch(object(), [], []) is None, None))
    return checks


def _stub_chain_checks():
    from infini_dist.kernels.elementwise_chain import prepare
    checks = []
    for chain, shapes, dtype in chain_cases():
        what = f"chain {chain.steps[0].op}.. {shapes}"
        launch = prepare(chain, shapes, [dtype] * len(shapes))
        described = []
        for call in range(4):
            inputs = chain_inputs(shapes, dtype, call)
            runs = NORMAL_RUNS[0]
            outs = launch(inputs)
            names = {t.data_ptr(): f"in{i}" for i, t in enumerate(inputs)}
            names.update({t.data_ptr(): f"out{i}" for i, t in enumerate(outs)})
            described.append(take_launch(names))
            took_fast = NORMAL_RUNS[0] == runs
            # call 0: ninetoothed's launcher; 1: the FastLaunch's first (normal) call; then fast
            checks.append((f"{what} call {call}: path", took_fast == (call >= 2), took_fast))
        checks.append((f"{what}: same launches", all(d == described[0] for d in described),
                       described))
        fast = launch.state["fast"]
        checks.append((f"{what}: fast", bool(fast) and fast.fast, None))
        inputs = chain_inputs(shapes, dtype, 9)
        runs = NORMAL_RUNS[0]
        launch([inputs[0].t().contiguous().t()] + inputs[1:])  # strided: the normal path
        LAUNCHES.clear()
        checks.append((f"{what}: strided input takes the normal path", NORMAL_RUNS[0] > runs,
                       None))
    return checks



def _timed(fn, number=300, repeat=7) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def _stub_host_costs(shape=(1, 4096), dtype=torch.bfloat16) -> dict:
    """us per call of Python with the launch stubbed out (best of several timings)."""
    import torch.distributed as dist

    import infini_dist
    from infini_dist.scheduler.backends.nccl_epilogue import NcclEpilogueAlgorithm
    from infini_dist.scheduler.backends.symm_launch import PreparedLaunch
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    from test_nccl_epilogue_cpu import span_and_meta, tensors_for
    costs = {}
    world_size, rank = 4, 1
    for kind in ("one_shot", "two_shot"):
        for pattern in ("add_rms_norm", "relu_scale"):
            algorithm = symm_algorithm(kind)
            graph, plan = symm_plan(kind, pattern, shape, dtype, world_size, rank)
            buffer = from_peer_tensors([torch.zeros(header_bytes(world_size) + (1 << 20),
                                                    dtype=torch.uint8)
                                        for _ in range(world_size)], rank)
            env = make_inputs(graph, shape, dtype, rank, 0)
            prepared = PreparedLaunch(algorithm, plan, buffer, env)
            costs[f"{kind} {pattern}"] = (_timed(lambda: algorithm.launch(plan, env, buffer)),
                                          _timed(lambda: prepared(env)))
    saved, dist.all_reduce = dist.all_reduce, lambda tensor, group=None: None
    try:
        settings = infini_dist.config.snapshot()
        for name in ("add_rms_norm", "relu_scale"):
            span, meta = span_and_meta(name, shape, dtype, device=torch.device("cpu"))
            env = {n: t.to(meta[n].dtype) for n, t in tensors_for(name, shape, dtype).items()}
            times = []
            for fast in (False, True):
                ctx = RunContext(None, world_size, rank, torch.device("cpu"),
                                 settings=dataclasses.replace(settings, fast_launch=fast))
                run = NcclEpilogueAlgorithm().compile(span, meta, ctx)
                times.append(_timed(lambda: run(env)))
            costs[f"nccl+nt_epilogue {name}"] = tuple(times)
    finally:
        dist.all_reduce = saved
    LAUNCHES.clear()
    return costs



@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    with stub_pool(str(tmp_path_factory.mktemp("stub_home"))) as pool:
        yield pool


def _assert_checks(checks):
    failed = [(what, detail) for what, ok, detail in checks if not ok]
    assert not failed, repr(failed)[:4000]


def test_symm_fast_path_hands_the_launcher_what_the_normal_path_does(stub):
    _assert_checks(run_in_pool(stub, _stub_symm_checks))


def test_chain_fast_path_hands_the_launcher_what_the_normal_path_does(stub):
    _assert_checks(run_in_pool(stub, _stub_chain_checks))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile
    with stub_pool(tempfile.mkdtemp(), record=False) as pool:
        costs = pool.submit(_stub_host_costs).result()
    print("host us per call, launch stubbed (normal path -> fast path)")
    for what, (normal, fast) in costs.items():
        print(f"  {what:32s} {normal:7.1f} -> {fast:6.1f}")
