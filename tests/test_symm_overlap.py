"""scheduler/backends/symm_overlap.py: `ce_overlap`, an all_reduce's input copied into every
rank's slot while the site's beside work (weight-gradient GEMMs) runs, then reduced with the
epilogue by kernels/chunk_reduce.py. Interpreted on 2 and 3 CPU ranks (shared CPU memory as the
symmetric buffers; plain copies, no streams off the GPU, then the driver calls a GPU call makes,
on a stand-in driver): every output, the GEMMs' too, against the fp32 reference and bitwise
equal across ranks; on GPUs, with the copy engine on a side stream: tests/gpu_overlap_worker.py
(test_on_gpus)."""

from __future__ import annotations

import pytest
import torch

import gemm_cases
from infini_dist.scheduler.ir import OpNode, SubGraph
from multirank import run_ranks
from symm_cases import digest, full_span, make_inputs, max_error, meta_of, reference

F32, BF16 = torch.float32, torch.bfloat16
_AR = OpNode("all_reduce", ("x",), ("y",))

# A backward graph's sites: the input gradient's all_reduce, its epilogue (the norm backward's
# muls, or a residual add + RMSNorm), and the weight gradients beside it.
PATTERNS = {
    "one_gemm_mul": SubGraph((OpNode("weight_gradient", ("g", "a"), ("dw",)), _AR,
                              OpNode("mul", ("y", "s"), ("o",))), ("g", "a", "x", "s"),
                             ("dw", "o")),
    "two_gemms_norm": SubGraph((OpNode("weight_gradient", ("g", "a"), ("dw",)),
                                OpNode("weight_gradient", ("x", "a"), ("dv",)), _AR,
                                OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r"),
                                       {"eps": 1e-5})),
                               ("g", "a", "x", "res", "w"), ("dw", "dv", "n", "r")),
}


class MemmoveDriver:
    """kernels/cuda_driver.Driver's calls on CPU memory: the copies made, every call logged."""

    def __init__(self):
        self.log = []

    def record(self, event, stream):
        self.log.append(("record", event, stream))

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def copy(self, destination, source, nbytes, stream):
        import ctypes
        ctypes.memmove(destination, source, nbytes)
        self.log.append(("copy", stream))


def direct_path(prepared, driver):
    """`prepared` making its fork, copies and join through `driver` (DirectCalls), on made-up
    stream handles; its launches logged with the stream each was given (the interpreter runs
    them on the CPU)."""
    from infini_dist.kernels import cuda_driver
    from infini_dist.scheduler.backends.symm_overlap import DirectCalls
    cuda_driver.raw_stream = lambda device: "caller"
    prepared.direct = DirectCalls(driver, 0, "side", "fork", "done",
                                  tuple(t.data_ptr() for t in prepared.targets),
                                  prepared.plan.tail.numel * prepared.plan.tail.dtype.itemsize,
                                  ())

    def logged(launch):
        def call(*tensors, stream=None):
            driver.log.append(("launch", stream))
            launch(*tensors)
        return call
    prepared.launches = [logged(launch) for launch in prepared.launches]


def expected_order(peers: int, launches: int, aside: bool) -> list:
    reduce = [("launch", "side" if aside else None)] * launches  # None: the current stream
    return ([("record", "fork", "caller"), ("wait", "side", "fork")] + [("copy", "side")] * peers
            + (reduce if aside else []) + [("record", "done", "side"), ("wait", "caller", "done")]
            + ([] if aside else reduce))


def interpreted_rank(rank, world_size, storage, cases):
    """Each case three times, every case on one shared buffer (its slots reused across calls
    and shapes): the first call through Triton's normal launch, the second through the
    launches the first call's layouts bound (PreparedOverlap), the third with its fork, copies
    and join as the driver calls a GPU call makes (a stand-in driver moving CPU memory), in
    the order checked."""
    import infini_dist
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    from infini_dist.kernels.symm_device import DEFAULT_TUNING
    from infini_dist.scheduler.choices import RunContext
    from infini_dist.scheduler.backends import symm_overlap
    from infini_dist.scheduler.backends.symm_overlap import PreparedOverlap
    symm_overlap.MIN_BYTES = 1  # the interpreter's sizes are tiny
    ctx = RunContext(None, world_size, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    buffer = from_peer_tensors(storage, rank)
    results = []
    for (pattern, shape, dtype), algorithm in ((case, a) for case in cases
                                               for a in symm_overlap.algorithms()):
        graph = PATTERNS[pattern]
        plan = algorithm.plan(full_span(graph), meta_of(graph, shape, dtype), ctx)
        assert plan is not None and algorithm.data_bytes(plan, world_size) <= buffer.data_bytes
        prepared = None
        for call in range(3):  # Triton's normal path, the launches bound once, the driver
            everyone = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
            if prepared is None:
                got = algorithm.launch(plan, everyone[rank], buffer)
                prepared = PreparedOverlap(algorithm, plan, buffer, everyone[rank],
                                           DEFAULT_TUNING, True)
                assert prepared.direct is None  # off the GPU
            elif call == 1:
                got = prepared(everyone[rank])
            else:
                driver = MemmoveDriver()
                direct_path(prepared, driver)
                got = prepared(everyone[rank])
                assert driver.log == expected_order(world_size - 1, len(prepared.launches),
                                                    algorithm.reduce_aside), driver.log
            assert set(got) == set(graph.output_names)
            error = max_error(got, reference(graph, everyone, rank))
            # a weight gradient is this rank's own (x is this rank's); the reduced values are
            # everyone's
            reduced = {n: t for n, t in got.items() if not n.startswith("d")}
            results.append(((pattern, shape, str(dtype), algorithm.name, call), error,
                            digest(reduced)))
    return results


def test_interpreted_two_ranks(monkeypatch):
    gemm_cases.run_interpreted(monkeypatch, interpreted_rank, 2, [
        ("one_gemm_mul", (2, 5, 16), F32),   # 3-D x: the GEMM reads the rows of g and a
        ("two_gemms_norm", (7, 32), F32)], 1 << 16)


def test_interpreted_three_ranks(monkeypatch):
    gemm_cases.run_interpreted(monkeypatch, interpreted_rank, 3, [
        ("two_gemms_norm", (6, 24), BF16), ("one_gemm_mul", (9, 8), F32)], 1 << 16)


def test_planning():
    """Offered where a site has beside work, on CUDA, from MIN_BYTES to MAX_BYTES; never for a
    site without beside work, with a prologue, or off the GPU; and only as a runs_beside
    algorithm, which the choice generator offers nowhere else."""
    from infini_dist.scheduler.backends.symm_overlap import MAX_BYTES, MIN_BYTES, algorithms
    from infini_dist.scheduler.choices import FusedSpan, RunContext
    from symm_cases import build
    assert [a.name for a in algorithms()] == ["ce_overlap", "ce_overlap_aside"]
    algorithm = algorithms()[1]
    assert algorithm.runs_beside
    cuda = RunContext(None, 2, 0, torch.device("cuda"))
    graph = PATTERNS["one_gemm_mul"]
    rows = MIN_BYTES // 2 // 256  # rows of 256 bf16 at the floor
    assert algorithm.supports(full_span(graph), meta_of(graph, (rows, 256), BF16), cuda)
    assert not algorithm.supports(full_span(graph), meta_of(graph, (rows - 1, 256), BF16), cuda)
    too_big = MAX_BYTES // 2 // 4096 + 1
    assert not algorithm.supports(full_span(graph), meta_of(graph, (too_big, 4096), BF16), cuda)
    assert not algorithm.supports(full_span(graph), meta_of(graph, (rows, 256), BF16, "cpu"),
                                  RunContext(None, 2, 0, torch.device("cpu")))
    span = full_span(graph)
    bare = FusedSpan(graph, span.prologue, span.anchors, span.epilogue)  # the beside left out
    assert not algorithm.supports(bare, meta_of(graph, (rows, 256), BF16), cuda)
    prologue = build("prologue_gelu")
    assert not algorithm.supports(full_span(prologue), meta_of(prologue, (rows, 256), BF16), cuda)


def _warm_up_rank(rank, world_size):
    """The compile-time warm-up launch, as symm_launch.warm_up makes it, on the warm-up's
    scratch (every 'peer' this rank's own memory, every barrier already met)."""
    from infini_dist.kernels.symm_buffers import local_scratch
    from infini_dist.scheduler.backends import symm_overlap
    from infini_dist.scheduler.choices import RunContext
    symm_overlap.MIN_BYTES = 1
    graph = PATTERNS["two_gemms_norm"]
    ctx = RunContext(None, 2, 0, torch.device("cuda"))
    done = []
    for algorithm in symm_overlap.algorithms():
        plan = algorithm.plan(full_span(graph), meta_of(graph, (4, 16), BF16), ctx)
        scratch = local_scratch(2, 0, algorithm.data_bytes(plan, 2), "cpu")
        for call in range(3):  # calls after the first find the barriers' flags still raised
            out = algorithm.launch(plan, make_inputs(graph, (4, 16), BF16, 0, call), scratch)
        done.append(sorted((name, tuple(t.shape)) for name, t in out.items()))
    return done


def test_the_warm_up_runs_alone():
    # the compile step's warm-up has no peer: a barrier waiting on one would hang the compile
    (done,) = run_ranks(_warm_up_rank, 1, timeout=240, env={"TRITON_INTERPRET": "1"})
    assert done == [[("dv", (16, 16)), ("dw", (16, 16)), ("n", (4, 16)), ("r", (4, 16))]] * 2


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_weight_gradient_op(dtype):
    """The op's reference (fp32, rounded once) and its native spelling (the backward graph's
    mm(permute(dy), x)) agree, over the rows of 3-D inputs; mismatched rows are refused."""
    from infini_dist.scheduler import op_registry
    dy = torch.randn(2, 5, 6).to(dtype)
    x = torch.randn(2, 5, 4).to(dtype)
    spec = op_registry.get_op("weight_gradient")
    expected = dy.reshape(10, 6).double().t() @ x.reshape(10, 4).double()
    ref, native = spec.fn(dy, x), spec.native(dy, x)
    assert ref.shape == native.shape == (6, 4) and ref.dtype == native.dtype == dtype
    tol = 1e-5 if dtype == F32 else 2e-2
    for got in (ref, native):
        assert torch.allclose(got.double(), expected, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="same rows"):
        spec.fn(dy, torch.randn(2, 4, 4).to(dtype))


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    """tests/gpu_overlap_worker.py on the machine's GPUs (up to 4): both choices at the TP
    decoder's backward shapes, eagerly and under capture, then the engine on the sites."""
    import os
    import sys

    from multirank import SAFE_GPU_ENV, run_process
    gpus = torch.cuda.device_count()
    env = dict(os.environ, **SAFE_GPU_ENV, INFINI_DIST_CACHE_DIR=str(tmp_path / "cache"),
               OVERLAP_ENGINE_TOKENS="2048")
    worker = os.path.join(os.path.dirname(__file__), "gpu_overlap_worker.py")
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={min(gpus, 4)}", worker], env=env, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ALL OK" in done.stdout
