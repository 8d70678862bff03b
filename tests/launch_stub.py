"""Shared by the fast-launch tests (test_launch_fast_path*.py, test_first_call_state.py): the
cases, and a stand-in GPU driver under which Triton runs its real (compiling) launch path on
the CPU: compiling yields a CompiledKernel whose launcher only records what it is handed
(`LAUNCHES`), and every normal-path launch is counted (`NORMAL_RUNS`). The driver is installed
in a spawned worker (`stub_pool`); functions submitted to it run there.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from infini_dist.scheduler.choices import RunContext
from interpreter_worker import closing_pool
from symm_cases import build, full_span, meta_of

SYMM_CASES = [("one_shot", "add_rms_norm", (3, 40), torch.float32),
              ("two_shot", "prologue_norm", (3, 40), torch.float32),
              ("two_shot", "swiglu_up", (2, 64), torch.bfloat16),
              ("one_shot", "relu_scale", (3, 333), torch.float32)]


def symm_algorithm(kind):
    from symm_runs import symm_algorithms
    return symm_algorithms()[kind]


def symm_plan(kind, pattern, shape, dtype, world_size, rank):
    from infini_dist.scheduler.backends.symm import plan_span
    graph = build(pattern)
    ctx = RunContext(None, world_size, rank, torch.device("cuda"))
    return graph, plan_span(full_span(graph), meta_of(graph, shape, dtype), ctx)


def stub_symm_case(kind, pattern, shape, dtype, world_size=4, rank=1):
    """(algorithm, graph, plan, buffer) of a SYMM_CASES entry in the stub process, where the
    peers' buffers are plain host tensors: launches there only record their arguments."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    graph, plan = symm_plan(kind, pattern, shape, dtype, world_size, rank)
    buffer = from_peer_tensors([torch.zeros(header_bytes(world_size) + (1 << 16),
                                            dtype=torch.uint8) for _ in range(world_size)], rank)
    return symm_algorithm(kind), graph, plan, buffer



def chain_cases():
    from infini_dist.kernels.chain import chain_from_nodes
    from infini_dist.scheduler.ir import OpNode
    add_norm = chain_from_nodes([OpNode("add", ("y", "res"), ("h",)),
                                 OpNode("rms_norm", ("h", "w"), ("out",), {"eps": 1e-5})],
                                ("y", "res", "w"), ("h", "out"))
    relu_scale = chain_from_nodes([OpNode("relu", ("y",), ("r",)),
                                   OpNode("scale", ("r",), ("out",), {"scale": 0.125})],
                                  ("y",), ("out",))
    # an FP8 output and a per-row one (the scales, rows x 1) beside the residual sum
    per_token = chain_from_nodes([OpNode("add_rms_norm", ("y", "res", "w"), ("n", "h")),
                                  OpNode("quant_fp8_per_token", ("n",), ("q", "s"))],
                                 ("y", "res", "w"), ("h", "q", "s"))
    return [(add_norm, [(3, 37), (3, 37), (37,)], torch.bfloat16),
            (relu_scale, [(5, 37)], torch.float32),
            (per_token, [(3, 37), (3, 37), (37,)], torch.bfloat16)]


def chain_inputs(shapes, dtype, call):
    g = torch.Generator().manual_seed(100 + call)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]



# ---- Triton's real launch path, with a stand-in GPU driver ---------------------------------------

LAUNCHES = []  # what the stub launcher was handed, one tuple per launch
NORMAL_RUNS = [0]  # JITFunction.run calls: the normal path
CURRENT_DEVICE = [0]


class StubDriver:
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

    triton.runtime.driver.set_active(StubDriver())

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


def stub_pool(home, record=True):
    return closing_pool(ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_stub_start,
        initargs=(home, record)))


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


def take_launch(names) -> tuple:
    assert len(LAUNCHES) == 1, len(LAUNCHES)
    launch = LAUNCHES.pop()
    return _described(launch, names)


def launch_names(env, outputs, buffer) -> dict:
    names = {t.data_ptr(): n for n, t in env.items()}
    names.update({t.data_ptr(): f"out:{n}" for n, t in outputs.items()})
    names.update({buffer.data_table.data_ptr(): "data_table",
                  buffer.signal_table.data_ptr(): "signal_table",
                  buffer.epoch.data_ptr(): "epoch"})
    return names



def _compile_start(home):
    """Pool initializer: the stand-in driver only, so Triton's CUDA backend compiles for real
    (sm_90, down to a cubin) on the CPU; nothing is launched."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["HOME"] = home
    os.environ["TRITON_CACHE_DIR"] = os.path.join(home, "triton_cache")
    os.makedirs(home, exist_ok=True)
    import triton
    triton.runtime.driver.set_active(StubDriver())


def compile_pool(home):
    return closing_pool(ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"),
        initializer=_compile_start, initargs=(home,)))
