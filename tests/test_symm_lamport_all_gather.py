"""kernels/lamport_all_gather.py as its plain callable and through its engine algorithm
(scheduler/backends/symm_gather.py), on Triton-interpreted CPU ranks whose "symmetric" buffers
are shared memory, and on 2 GPUs against NCCL's all_gather_into_tensor: the gathered bits equal
torch.cat of every rank's input (-0.0 arriving as +0.0), the same on every rank, every polled
place emptied after each call, shapes and dtypes changing between calls on one buffer."""

from __future__ import annotations

import re

import pytest
import torch

from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta, algorithms_for
from infini_dist.scheduler.ir import OpNode, SubGraph
from multirank import SAFE_GPU_ENV, run_ranks

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (shape, dtype): one item; several programs; 3 dims; more items than programs (128), so that a
# program pushes and polls two
CASES = [((5, 40), F32), ((3, 1000), BF16), ((2, 3, 7), F16), ((1, 16000), BF16),
         ((300, 512), F32)]


def _input(shape, dtype, rank, call) -> torch.Tensor:
    """Random values with the special ones a gather must carry: ±0.0, ±inf, NaN."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(100 * call + rank),
                    dtype=torch.float64).to(dtype)
    flat = t.view(-1)
    for i, value in enumerate((-0.0, 0.0, float("inf"), float("-inf"), float("nan"))):
        flat[(7 * i + rank) % flat.numel()] = value
    return t


def _expected(shape, dtype, world, call) -> torch.Tensor:
    """torch.cat of every rank's input, with -0.0 as +0.0 (the one value whose bits change)."""
    out = torch.cat([_input(shape, dtype, r, call) for r in range(world)])
    return torch.where(out == 0, torch.zeros_like(out), out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _graph(world: int) -> SubGraph:
    gather = OpNode("all_gather", ("x",), ("g",), {"group_size": world, "group_name": "g"})
    return SubGraph((gather,), ("x",), ("g",))


def _meta(shape, dtype, world, device="cuda") -> dict:
    out = (world * shape[0],) + tuple(shape[1:])
    return {"x": TensorMeta(tuple(shape), dtype, torch.device(device), True),
            "g": TensorMeta(out, dtype, torch.device(device), True)}


def gather_rank(rank, world, storages, cases):
    """Each case twice, by the plain callable and by the engine's runner, on the buffers of each
    empty-pattern width: per call (case, whether the bits are right, the gathered bits' digest,
    whether every place of this rank's buffer is empty again)."""
    import torch.distributed as dist

    import infini_dist
    from infini_dist.kernels.lamport_all_gather import lamport_all_gather
    from infini_dist.kernels.symm_buffers import EMPTY_PATTERN, from_peer_tensors, header_bytes
    from infini_dist.scheduler.backends import symm_gather
    from infini_dist.scheduler.backends.symm_launch import tuning_of
    from symm_cases import digest
    buffers = {width: from_peer_tensors(s, rank) for width, s in storages.items()}
    ctx = RunContext(None, world, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    (algorithm,) = [a for a in algorithms_for("all_gather", "cuda")
                    if a.name == "lamport_all_gather"]
    # The runner on these buffers: no CUDA warm-up, the buffer of the width in place of the
    # symmetric one its first call would allocate.
    symm_gather.warm_up = lambda algorithm, plan, names, meta, ctx: (
        algorithm.data_bytes(plan, ctx.world_size), tuning_of(ctx.settings), True)
    symm_gather.symm_buffers.get_buffer = lambda group, device, kind, size, width: buffers[width]

    def emptied(width):  # once every rank is done with the call, before any starts the next
        dist.barrier()
        dtype, pattern = EMPTY_PATTERN[width]
        data = storages[width][rank][header_bytes(world):].view(dtype)
        empty = bool((data == pattern).all())
        dist.barrier()
        return empty

    results = []
    for shape, dtype in cases:
        width = dtype.itemsize * 8
        span = FusedSpan(_graph(world), (), (0,), ())
        run = algorithm.compile(span, _meta(shape, dtype, world), ctx)
        for call in range(2):
            x = _input(shape, dtype, rank, call)
            want = _expected(shape, dtype, world, call)
            into = torch.full_like(want, 7.0)
            for path, got in (("callable", lambda: lamport_all_gather(x, buffer=buffers[width])),
                              ("into", lambda: lamport_all_gather(x, out=into,
                                                                  buffer=buffers[width])),
                              ("runner", lambda: run({"x": x})["g"])):
                got = got()
                right = got.shape == want.shape and torch.equal(_bits(got), _bits(want))
                results.append(((shape, str(dtype), call, path), right,
                                digest({"g": got}), emptied(width)))
    return results


def _storages(world: int) -> dict:
    from infini_dist.kernels.symm_buffers import fill_empty, header_bytes
    storages = {}
    for width in (16, 32):
        storages[width] = [torch.zeros(header_bytes(world) + (4 << 20), dtype=torch.uint8)
                           .share_memory_() for _ in range(world)]
        for storage in storages[width]:
            fill_empty(storage, world, width)
    return storages


@pytest.mark.parametrize("world", [2, 3])
def test_interpreted(monkeypatch, world):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    per_rank = run_ranks(gather_rank, world, _storages(world), CASES, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    assert all(isinstance(r, list) for r in per_rank), repr(per_rank)[:2000]
    for results in zip(*per_rank):
        case = results[0][0]
        for rank, (_, right, _, empty) in enumerate(results):
            assert right, f"{case} rank {rank}: wrong bits"
            assert empty, f"{case} rank {rank}: a polled place was left full"
        assert len({bits for _, _, bits, _ in results}) == 1, f"{case}: ranks differ"


@pytest.mark.parametrize("x, message, options", [
    (torch.ones(4, 4, dtype=torch.int32), "float16, bfloat16 or float32", {}),
    (torch.tensor(1.0), "at least one dim", {}),
    (torch.ones(0, 4), "non-empty", {}),
    (torch.ones(512, 512), "this call needs", {}),
    (torch.ones(4, 4), "shape (8, 4)", {"out": torch.empty(4, 4)}),
    (torch.ones(4, 4), "torch.float32", {"out": torch.empty(8, 4, dtype=torch.bfloat16)}),
    (torch.ones(4, 4), "contiguous", {"out": torch.empty(4, 8).t()}),
])
def test_callable_refuses_bad_input(x, message, options):
    from infini_dist.kernels.lamport_all_gather import lamport_all_gather
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 20), dtype=torch.uint8)
                                for _ in range(2)], 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        lamport_all_gather(x, buffer=buffer, **options)


def test_plan_takes_a_lone_gather_of_the_whole_group_only():
    from infini_dist.scheduler.backends.symm_gather import MAX_BYTES, plan_gather
    ctx = RunContext(None, 2, 0, torch.device("cuda"))
    span = FusedSpan(_graph(2), (), (0,), ())
    assert plan_gather(span, _meta((4, 40), BF16, 2), ctx) is not None
    assert plan_gather(span, _meta((4, 40), BF16, 2, "cpu"),
                       RunContext(None, 2, 0, torch.device("cpu"))) is None
    assert plan_gather(span, _meta((4, 40), BF16, 2), RunContext(
        None, 4, 0, torch.device("cuda"))) is None  # a subgroup's gather
    assert plan_gather(span, _meta((4, 40), BF16, 2), RunContext(
        None, 2, 0, torch.device("cuda"), single_host=False)) is None
    assert plan_gather(span, {"x": TensorMeta((4, 40), torch.int32, torch.device("cuda"), True)},
                       ctx) is None
    rows = MAX_BYTES // (40 * 2)
    assert plan_gather(span, _meta((rows, 40), BF16, 2), ctx) is not None
    assert plan_gather(span, _meta((rows + 1, 40), BF16, 2), ctx) is None
    norm = SubGraph((OpNode("relu", ("y",), ("x",)),) + _graph(2).nodes, ("y",), ("g",))
    assert plan_gather(FusedSpan(norm, (0,), (1,), ()), _meta((4, 40), BF16, 2), ctx) is None


def compile_for_gpu(shape, dtype):
    """In the compile worker: the kernel as the engine launches it, compiled for sm_90."""
    from infini_dist.kernels.lamport_all_gather import lamport_all_gather_launch
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 20), dtype=torch.uint8)
                                for _ in range(2)], 0)
    x = torch.ones(shape, dtype=dtype)
    out = torch.empty((2 * shape[0],) + tuple(shape[1:]), dtype=dtype)
    jit, grid, args, kwargs = lamport_all_gather_launch(x, buffer, out)
    return sorted(jit.warmup(*args, grid=grid, **kwargs).asm)


def test_compiles_for_sm90(tmp_path):
    """The interpreter compiles nothing: the GPU compiler (sm_90, to a cubin) must take it too."""
    pytest.importorskip("triton.backends.nvidia")
    from launch_stub import compile_pool
    with compile_pool(str(tmp_path / "home")) as pool:
        for case in (((4, 1000), BF16), ((3, 40), F32)):
            assert "cubin" in pool.submit(compile_for_gpu, *case).result(timeout=600), case


# ---- on GPUs: against NCCL's gather, eagerly and replayed from a CUDA graph --------------------

GPU_CASES = [((1, 16000), BF16), ((32, 16000), BF16), ((8, 4096), F32), ((3, 5, 7), F16),
             ((2048, 2048), BF16)]


def gpu_rank(rank, world):
    import torch.distributed as dist

    from infini_dist.kernels.lamport_all_gather import lamport_all_gather
    from symm_cases import digest
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    results = []
    for shape, dtype in GPU_CASES:
        for call in range(3):  # both halves, then the first again
            x = _input(shape, dtype, rank, call).to(device)
            nccl = torch.empty((world * shape[0],) + shape[1:], dtype=dtype, device=device)
            dist.all_gather_into_tensor(nccl, torch.where(x == 0, torch.zeros_like(x), x))
            got = lamport_all_gather(x)
            results.append(((shape, str(dtype), call, "eager"),
                            torch.equal(_bits(got), _bits(nccl)), digest({"g": got})))
        # A CUDA graph replayed with new inputs: the halves alternate on the device.
        static = _input(shape, dtype, rank, 0).to(device)
        lamport_all_gather(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = lamport_all_gather(static)
        for call in range(3, 6):
            static.copy_(_input(shape, dtype, rank, call))
            graph.replay()
            want = _expected(shape, dtype, world, call).to(device)
            results.append(((shape, str(dtype), call, "graph"),
                            torch.equal(_bits(captured), _bits(want)), digest({"g": captured})))
    torch.cuda.synchronize()
    return results


@pytest.mark.gpu
@pytest.mark.multigpu
def test_on_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    per_rank = run_ranks(gpu_rank, 2, backend="nccl", env=SAFE_GPU_ENV, timeout=240)
    for results in zip(*per_rank):
        case = results[0][0]
        assert all(right for _, right, _ in results), f"{case}: not NCCL's bits"
        assert len({bits for _, _, bits in results}) == 1, f"{case}: ranks differ"
