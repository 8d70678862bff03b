"""The fast launch path (`nt_runtime.FastLaunch`) of the symmetric-memory runners
(`backends.symm.PreparedLaunch`) and of the ninetoothed chain kernels
(`elementwise_chain.prepare`).

Two halves:
- Triton's interpreter (CPU): the prepared launches give bitwise the outputs of the normal path,
  and, the interpreter returning no CompiledKernel, every FastLaunch falls back to the normal path
  for good after its first call.
- Triton's real (compiling) launch path, on the CPU: a child process with a stand-in GPU driver,
  where compiling yields a CompiledKernel whose launcher only records what it is handed. The
  fast path must hand the launcher exactly what the normal path hands it (same grid, stream and
  argument list: tensors by address, everything else by value), take over after the first call,
  and give the call back to the normal path whenever Triton would pick another kernel
  (unaligned or other-dtype tensors, another device) or the feature is missing or switched off.

`python tests/test_launch_fast_path.py` prints the host cost per call with the launch stubbed
out (a measurement, not a test: timings under CI load prove nothing).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from infini_dist.scheduler.choices import RunContext
from interpreter_worker import interpreter_pool, interpreter_unusable, run
from multirank import run_ranks
from symm_cases import build, full_span, make_inputs, max_error, meta_of, reference

SYMM_CASES = [("one_shot", "add_rms_norm", (3, 40), torch.float32),
              ("two_shot", "prologue_norm", (3, 40), torch.float32),
              ("two_shot", "swiglu_up", (2, 64), torch.bfloat16),
              ("one_shot", "relu_scale", (3, 333), torch.float32)]


def _algorithm(kind):
    from symm_runs import symm_algorithms
    return symm_algorithms()[kind]


def _plan(kind, pattern, shape, dtype, world_size, rank):
    from infini_dist.scheduler.backends.symm import plan_span
    graph = build(pattern)
    ctx = RunContext(None, world_size, rank, torch.device("cuda"))
    return graph, plan_span(full_span(graph), meta_of(graph, shape, dtype), ctx)


def _stub_symm_case(kind, pattern, shape, dtype, world_size=4, rank=1):
    """(algorithm, graph, plan, buffer) of a SYMM_CASES entry in the stub process, where the
    peers' buffers are plain host tensors: launches there only record their arguments."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    graph, plan = _plan(kind, pattern, shape, dtype, world_size, rank)
    buffer = from_peer_tensors([torch.zeros(header_bytes(world_size) + (1 << 16),
                                            dtype=torch.uint8) for _ in range(world_size)], rank)
    return _algorithm(kind), graph, plan, buffer


# ---- the interpreter: same outputs, fallback detected --------------------------------------------

def _interpreted_symm_rank(rank, world_size, storages):
    from infini_dist.scheduler.backends.symm import PreparedLaunch
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    report = []
    for index, (kind, pattern, shape, dtype) in enumerate(SYMM_CASES):
        algorithm = _algorithm(kind)
        graph, plan = _plan(kind, pattern, shape, dtype, world_size, rank)
        buffer = from_peer_tensors(storages[index], rank)
        prepared = None
        for call in range(3):
            inputs = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
            env = inputs[rank]
            if call == 2:  # a strided source: the prepared launch hands it to the normal path
                env = dict(env, x=env["x"].t().contiguous().t())
            normal = algorithm.launch(plan, env, buffer)
            prepared = prepared or PreparedLaunch(algorithm, plan, buffer, env)
            fast = prepared(env)
            expected = reference(graph, inputs, rank)
            report.append({
                "case": (kind, pattern, shape, str(dtype), call),
                "same": sorted(normal) == sorted(fast) and all(
                    torch.equal(normal[n], fast[n]) for n in normal),
                "error": max(max_error(normal, expected), max_error(fast, expected)),
                "fast": prepared.launch.fast, "normal_only": prepared.launch.normal_only})
    return report


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_prepared_symm_launch_matches_the_normal_path_interpreted(monkeypatch):
    from infini_dist.kernels.symm_buffers import header_bytes
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    world_size = 2
    storages = [[torch.zeros(header_bytes(world_size) + (1 << 16), dtype=torch.uint8)
                 .share_memory_() for _ in range(world_size)] for _ in SYMM_CASES]
    per_rank = run_ranks(_interpreted_symm_rank, world_size, storages, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    for report in per_rank:
        assert len(report) == 3 * len(SYMM_CASES)
        for entry in report:
            tol = 1e-5 if "float32" in entry["case"][3] else 3e-2
            assert entry["same"], entry
            assert entry["error"] <= tol, entry
            # No CompiledKernel under the interpreter: the normal path, for good.
            assert not entry["fast"] and entry["normal_only"], entry


def _chain_cases():
    from infini_dist.kernels.chain import chain_from_nodes
    from infini_dist.scheduler.ir import OpNode
    add_norm = chain_from_nodes([OpNode("add", ("y", "res"), ("h",)),
                                 OpNode("rms_norm", ("h", "w"), ("out",), {"eps": 1e-5})],
                                ("y", "res", "w"), ("h", "out"))
    relu_scale = chain_from_nodes([OpNode("relu", ("y",), ("r",)),
                                   OpNode("scale", ("r",), ("out",), {"scale": 0.125})],
                                  ("y",), ("out",))
    return [(add_norm, [(3, 37), (3, 37), (37,)], torch.bfloat16),
            (relu_scale, [(5, 37)], torch.float32)]


def _chain_inputs(shapes, dtype, call):
    g = torch.Generator().manual_seed(100 + call)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _interpreted_chain_runs():
    from infini_dist.kernels.elementwise_chain import elementwise_chain, prepare
    report = []
    for chain, shapes, dtype in _chain_cases():
        launch = prepare(chain, shapes, [dtype] * len(shapes))
        for call in range(4):
            inputs = _chain_inputs(shapes, dtype, call)
            expected = elementwise_chain(chain, *inputs)  # a fresh prepare: the normal path
            # At the last call the first output goes into the first input, as nccl+nt does.
            outs = [inputs[0]] + [None] * (len(chain.outputs) - 1) if call == 3 else None
            got = launch(inputs, outs)
            fast = launch.state["fast"]
            report.append({"same": all(torch.equal(a, b) for a, b in zip(got, expected)),
                           "count": (len(got), len(expected)),
                           "built": bool(fast), "fast": bool(fast) and fast.fast,
                           "normal_only": bool(fast) and fast.normal_only})
    return report


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_chain_fast_path_matches_the_normal_path_interpreted(tmp_path):
    with interpreter_pool(str(tmp_path / "home")) as pool:
        report = run(pool, _interpreted_chain_runs, timeout=300)
    assert len(report) == 4 * len(_chain_cases())
    for call, entry in enumerate(report):
        assert entry["same"] and entry["count"][0] == entry["count"][1], entry
        if call % 4 >= 1:  # built at the second call, then on the normal path for good
            assert entry["built"] and entry["normal_only"] and not entry["fast"], entry


# ---- Triton's real launch path, with a stand-in GPU driver ---------------------------------------

LAUNCHES = []  # what the stub launcher was handed, one tuple per launch
NORMAL_RUNS = [0]  # JITFunction.run calls: the normal path
CURRENT_DEVICE = [0]


class _StubDriver:
    def __init__(self):
        from types import SimpleNamespace
        self.utils = SimpleNamespace(get_device_properties=lambda device: {
            "max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132,
            "warpSize": 32})

    def is_active(self):
        return True

    def get_current_device(self):
        return CURRENT_DEVICE[0]

    def set_current_device(self, device):
        CURRENT_DEVICE[0] = device

    def get_current_stream(self, device=None):
        return 1000 + device

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


def _stub_start(home, record):
    """Pool initializer: Triton compiles nothing and launches nothing, but runs its whole
    Python launch path: JITFunction.run binds, specialises, looks up the kernel by its key and
    calls CompiledKernel.run, which here records its arguments (or does nothing)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["HOME"] = home
    os.makedirs(home, exist_ok=True)
    torch.set_num_threads(1)
    import triton
    from triton.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    triton.runtime.driver.set_active(_StubDriver())

    def launcher(*args):
        if record:
            LAUNCHES.append(args)

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = CompiledKernel.__new__(CompiledKernel)  # no binary: nothing to load
        kernel.module, kernel._module_pid, kernel.function = object(), None, 7
        kernel.packed_metadata, kernel.name, kernel.src = ("packed",), "stub", None
        kernel._run = launcher
        self.device_caches[device][0][key] = kernel
        return kernel

    normal_run = JITFunction.run

    def counted_run(self, *args, **kwargs):
        NORMAL_RUNS[0] += 1
        return normal_run(self, *args, **kwargs)

    JITFunction._do_compile = do_compile
    JITFunction.run = counted_run


def _stub_pool(home, record=True):
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_stub_start, initargs=(home, record))


def _described(launch, names: dict) -> tuple:
    """A recorded launch with tensors named by their address (`names`: address -> name)."""
    grid_and_stream, function, packed, metadata = launch[:4], launch[4], launch[5], launch[6]
    return grid_and_stream, function, packed, type(metadata).__name__, _named(launch[9:], names)


def _named(value, names):
    """`value` with every tensor, also inside tuple arguments, as (name, dtype)."""
    if isinstance(value, torch.Tensor):
        return names.get(value.data_ptr(), f"unknown@{value.data_ptr()}"), str(value.dtype)
    if isinstance(value, tuple):
        return tuple(_named(v, names) for v in value)
    return value


def _take_launch(names) -> tuple:
    assert len(LAUNCHES) == 1, len(LAUNCHES)
    launch = LAUNCHES.pop()
    return _described(launch, names)


def _names(env, outputs, buffer) -> dict:
    names = {t.data_ptr(): n for n, t in env.items()}
    names.update({t.data_ptr(): f"out:{n}" for n, t in outputs.items()})
    names.update({buffer.data_table.data_ptr(): "data_table",
                  buffer.signal_table.data_ptr(): "signal_table",
                  buffer.epoch.data_ptr(): "epoch"})
    return names


def _stub_symm_checks():
    """In the stub process. Returns a list of (what, ok, detail)."""
    from infini_dist.kernels import nt_runtime
    from infini_dist.scheduler.backends.symm import PreparedLaunch
    checks = []
    rank = 1
    for kind, pattern, shape, dtype in SYMM_CASES + [("two_shot", "add_rms_norm", (2, 64),
                                                      torch.bfloat16)]:
        what = f"{kind} {pattern} {shape} {dtype}"
        algorithm, graph, plan, buffer = _stub_symm_case(kind, pattern, shape, dtype, rank=rank)
        env = make_inputs(graph, shape, dtype, rank, 0)
        got = algorithm.launch(plan, env, buffer)
        normal = _take_launch(_names(env, got, buffer))
        prepared = PreparedLaunch(algorithm, plan, buffer, env)
        for call in range(3):
            env = make_inputs(graph, shape, dtype, rank, call)
            runs = NORMAL_RUNS[0]
            got = prepared(env)
            fast = _take_launch(_names(env, got, buffer))
            checks.append((f"{what} call {call}: same launch", fast == normal, (fast, normal)))
            took_fast = NORMAL_RUNS[0] == runs
            checks.append((f"{what} call {call}: fast path from the second call",
                           took_fast == (call > 0) and prepared.launch.fast, took_fast))

        def falls_back(why, env, addresses_known=True):
            runs = NORMAL_RUNS[0]
            got = prepared(env)
            launch = _take_launch(_names(env, got, buffer))
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
    for why in ("no CompiledKernel launcher", "INFINI_DIST_FAST_LAUNCH=0"):
        saved = nt_runtime._compiled_kernel_type
        if why.startswith("no"):
            nt_runtime._compiled_kernel_type = False
        else:
            os.environ["INFINI_DIST_FAST_LAUNCH"] = "0"
        try:
            algorithm, graph, plan, buffer = _stub_symm_case(kind, pattern, shape, dtype,
                                                             rank=rank)
            env = make_inputs(graph, shape, dtype, rank, 0)
            normal = _take_launch(_names(env, algorithm.launch(plan, env, buffer), buffer))
            prepared = PreparedLaunch(algorithm, plan, buffer, env)
            runs = NORMAL_RUNS[0]
            for _ in range(3):
                got = prepared(env)
                checks.append((f"{why}: same launch",
                               _take_launch(_names(env, got, buffer)) == normal, None))
            checks.append((f"{why}: normal path every call", NORMAL_RUNS[0] == runs + 3, None))
            checks.append((f"{why}: never fast", not prepared.launch.fast, None))
            if why.startswith("no"):
                checks.append((f"{why}: settled", prepared.launch.normal_only, None))
        finally:
            nt_runtime._compiled_kernel_type = saved
            os.environ.pop("INFINI_DIST_FAST_LAUNCH", None)
    checks.append(("ninetoothed handle without its kernel: no fast launch",
                   nt_runtime.fast_launch(object(), [], []) is None, None))
    return checks


def _stub_chain_checks():
    from infini_dist.kernels.elementwise_chain import prepare
    checks = []
    for chain, shapes, dtype in _chain_cases():
        what = f"chain {chain.steps[0].op}.. {shapes}"
        launch = prepare(chain, shapes, [dtype] * len(shapes))
        described = []
        for call in range(4):
            inputs = _chain_inputs(shapes, dtype, call)
            runs = NORMAL_RUNS[0]
            outs = launch(inputs)
            names = {t.data_ptr(): f"in{i}" for i, t in enumerate(inputs)}
            names.update({t.data_ptr(): f"out{i}" for i, t in enumerate(outs)})
            described.append(_take_launch(names))
            took_fast = NORMAL_RUNS[0] == runs
            # call 0: ninetoothed's launcher; 1: the FastLaunch's first (normal) call; then fast
            checks.append((f"{what} call {call}: path", took_fast == (call >= 2), took_fast))
        checks.append((f"{what}: same launches", all(d == described[0] for d in described),
                       described))
        fast = launch.state["fast"]
        checks.append((f"{what}: fast", bool(fast) and fast.fast, None))
        inputs = _chain_inputs(shapes, dtype, 9)
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
    from infini_dist.scheduler.backends.nccl_epilogue import NcclEpilogueAlgorithm
    from infini_dist.scheduler.backends.symm import PreparedLaunch
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    from test_nccl_epilogue_cpu import span_and_meta, tensors_for
    costs = {}
    world_size, rank = 4, 1
    for kind in ("one_shot", "two_shot"):
        for pattern in ("add_rms_norm", "relu_scale"):
            algorithm = _algorithm(kind)
            graph, plan = _plan(kind, pattern, shape, dtype, world_size, rank)
            buffer = from_peer_tensors([torch.zeros(header_bytes(world_size) + (1 << 20),
                                                    dtype=torch.uint8)
                                        for _ in range(world_size)], rank)
            env = make_inputs(graph, shape, dtype, rank, 0)
            prepared = PreparedLaunch(algorithm, plan, buffer, env)
            costs[f"{kind} {pattern}"] = (_timed(lambda: algorithm.launch(plan, env, buffer)),
                                          _timed(lambda: prepared(env)))
    saved, dist.all_reduce = dist.all_reduce, lambda tensor, group=None: None
    try:
        ctx = RunContext(None, world_size, rank, torch.device("cpu"))
        for name in ("add_rms_norm", "relu_scale"):
            span, meta = span_and_meta(name, shape, dtype, device=torch.device("cpu"))
            env = {n: t.to(meta[n].dtype) for n, t in tensors_for(name, shape, dtype).items()}
            times = []
            for fast in ("0", "1"):
                os.environ["INFINI_DIST_FAST_LAUNCH"] = fast
                run = NcclEpilogueAlgorithm().compile(span, meta, ctx)
                times.append(_timed(lambda: run(env)))
            costs[f"nccl+nt_epilogue {name}"] = tuple(times)
    finally:
        dist.all_reduce = saved
        os.environ.pop("INFINI_DIST_FAST_LAUNCH", None)
    LAUNCHES.clear()
    return costs


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    with _stub_pool(str(tmp_path_factory.mktemp("stub_home"))) as pool:
        yield pool


def _assert_checks(checks):
    failed = [(what, detail) for what, ok, detail in checks if not ok]
    assert not failed, repr(failed)[:4000]


def test_symm_fast_path_hands_the_launcher_what_the_normal_path_does(stub):
    _assert_checks(stub.submit(_stub_symm_checks).result(timeout=300))


def test_chain_fast_path_hands_the_launcher_what_the_normal_path_does(stub):
    _assert_checks(stub.submit(_stub_chain_checks).result(timeout=300))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile
    with _stub_pool(tempfile.mkdtemp(), record=False) as pool:
        costs = pool.submit(_stub_host_costs).result()
    print("host us per call, launch stubbed (normal path -> fast path)")
    for what, (normal, fast) in costs.items():
        print(f"  {what:32s} {normal:7.1f} -> {fast:6.1f}")
