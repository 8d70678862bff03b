"""The symmetric-memory all-reduce kernels (one-shot, two-shot) and their engine algorithms.

On the CPU: span planning (what `supports` accepts), launch layouts, and the kernels themselves
run by Triton's interpreter in W processes whose "symmetric" buffers are shared CPU memory, each
process addressing its peers through its own mapping exactly as on GPUs. Program b of every rank
runs in the same order, so the barriers work in the interpreter as on the device.

On GPUs (`multigpu`): tests/gpu_symm_worker.py under torchrun, real symmetric memory, eager and
CUDA-graph replay.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from infini_dist.kernels import symm_chain
from infini_dist.kernels.symm_algorithms import (LamportOneShotAllReduce, LamportTwoShotAllReduce,
                                                 OneShotAllReduce, PolledGatherTwoShotAllReduce,
                                                 TwoShotAllReduce, plan_span)
from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta
from infini_dist.scheduler.ir import OpNode, SubGraph, find_sites
from multirank import run_ranks
from symm_cases import (PATTERNS, build, digest, full_span, make_inputs, max_error, meta_of,
                        reference)

CUDA4 = RunContext(None, 4, 1, torch.device("cuda", 1))


def spans_at_every_depth(graph):
    site = find_sites(graph)[0]
    for p in range(len(site.prologue) + 1):
        for e in range(len(site.epilogue) + 1):
            yield p, e, FusedSpan(graph, site.prologue[len(site.prologue) - p:], site.anchors,
                                  site.epilogue[:e])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_depth_of_every_pattern_is_planned(pattern):
    graph = build(pattern)
    meta = meta_of(graph, (4, 64), torch.bfloat16)
    for p, e, span in spans_at_every_depth(graph):
        plan = plan_span(span, meta, CUDA4)
        # add then rms_norm at depth 1 leaves `s` live, which we can write: all depths work.
        assert plan is not None, (pattern, p, e)
        assert set(plan.outputs) == set(span.outputs)
        assert OneShotAllReduce().supports(span, meta, CUDA4)
        assert TwoShotAllReduce().supports(span, meta, CUDA4)


def test_plan_of_add_rms_norm_names_both_outputs():
    graph = build("add_rms_norm")
    plan = plan_span(full_span(graph), meta_of(graph, (4, 64), torch.bfloat16), CUDA4)
    assert (plan.norm, plan.out, plan.pre, plan.residual, plan.weight, plan.eps) == (
        symm_chain.ADD_RMS_NORM.value, "n", "r", "res", "w", 1e-5)
    plan = plan_span(full_span(build("prologue_norm")),
                     meta_of(build("prologue_norm"), (4, 64), torch.float16), CUDA4)
    assert plan.residual == "res" and [op.code for op in plan.prologue] == [
        symm_chain.RELU.value] and [op.code for op in plan.epilogue] == [symm_chain.GELU.value]


def _span(nodes, inputs, outputs):
    graph = SubGraph(tuple(nodes), tuple(inputs), tuple(outputs))
    return graph, full_span(graph)


def _meta(shape=(4, 64), dtype=torch.bfloat16, device="cuda", **override):
    def m(s=shape, d=dtype):
        return TensorMeta(tuple(s), d, torch.device(device), True)
    values = {n: m() for n in ("x", "y", "a", "b", "res", "up", "n", "r", "s", "z")}
    values["w"] = m((shape[-1],))
    values.update({k: m(*v) for k, v in override.items()})
    return values


def test_plan_rejects_what_the_kernels_cannot_do():
    ar = OpNode("all_reduce", ("x",), ("y",))
    cases = {
        "y read twice": _span([ar, OpNode("mul", ("y", "y"), ("a",))], ["x"], ["a"]),
        "intermediate live": _span([ar, OpNode("relu", ("y",), ("a",)),
                                    OpNode("scale", ("a",), ("b",))], ["x"], ["a", "b"]),
        "side produced in span": _span([ar, OpNode("relu", ("y",), ("a",)),
                                        OpNode("add", ("a", "y"), ("b",))], ["x"], ["b"]),
        "op after norm": _span([ar, OpNode("rms_norm", ("y", "w"), ("n",)),
                                OpNode("relu", ("n",), ("a",))], ["x", "w"], ["a"]),
    }
    for why, (graph, span) in cases.items():
        assert plan_span(span, _meta(), CUDA4) is None, why

    graph, span = _span([ar, OpNode("add", ("y", "up"), ("a",))], ["x", "up"], ["a"])
    assert plan_span(span, _meta(), CUDA4) is not None
    assert plan_span(span, _meta(up=((64,), torch.bfloat16)), CUDA4) is None, "broadcast side"
    assert plan_span(span, _meta(up=((4, 64), torch.float32)), CUDA4) is None, "mixed dtypes"
    assert plan_span(span, _meta(dtype=torch.float64), CUDA4) is None, "fp64"
    assert plan_span(span, _meta(dtype=torch.int32), CUDA4) is None, "int"
    assert plan_span(span, _meta(device="cpu"), RunContext(None, 4, 1, torch.device("cpu"))) \
        is None, "cpu"
    assert plan_span(span, _meta(), RunContext(None, 1, 0, torch.device("cuda"))) is None

    graph, span = _span([ar, OpNode("rms_norm", ("y", "w"), ("n",))], ["x", "w"], ["n"])
    assert plan_span(span, _meta(), CUDA4) is not None
    assert plan_span(span, _meta(w=((4, 64), torch.bfloat16)), CUDA4) is None, "2-d weight"
    assert plan_span(span, _meta(shape=(2, 65536)), CUDA4) is None, "row too long"

    coalesced = SubGraph((OpNode("all_reduce", ("x", "z"), ("y", "n")),), ("x", "z"), ("y", "n"))
    site = find_sites(coalesced)[0]
    assert plan_span(FusedSpan(coalesced, (), site.anchors, ()), _meta(), CUDA4) is None

    graph, span = _span([ar], ["x"], ["y"])
    big = _meta(shape=(2048, 4096))  # 16 MiB of bf16: two-shot only
    assert not OneShotAllReduce().supports(span, big, CUDA4)
    assert TwoShotAllReduce().supports(span, big, CUDA4)


def test_encode_node_covers_the_elementwise_ops():
    enc = symm_chain.encode_node
    assert enc(OpNode("gelu", ("y",), ("a",), {"approximate": "tanh"}), "y").code == \
        symm_chain.GELU_TANH.value
    assert enc(OpNode("gelu", ("y",), ("a",), {"approximate": "bogus"}), "y") is None
    assert enc(OpNode("scale", ("y",), ("a",), {"scale": 3}), "y").scalar == 3.0
    assert enc(OpNode("swiglu", ("y", "u"), ("a",)), "y") == symm_chain.ChainOp(
        symm_chain.SWIGLU_GATE.value, 0.0, "u")
    assert enc(OpNode("swiglu", ("g", "y"), ("a",)), "y").code == symm_chain.SWIGLU_UP.value
    assert enc(OpNode("add", ("u", "y"), ("a",)), "y").side == "u"


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 16])
def test_layout_is_shape_only_and_fits(world_size):
    for numel, row_len, norm in [(1, None, 0), (999, None, 0), (8 * 4096, None, 0),
                                 (8192 * 4096, 4096, 2), (3 * 37, 37, 1), (130 * 8, 8, 2)]:
        layout = symm_chain.launch_layout(numel, row_len, norm, world_size)
        assert 1 <= layout.grid <= symm_chain.MAX_PROGRAMS
        assert layout.sub % 16 == 0 and layout.sub * world_size >= layout.item
        assert layout.block >= layout.item and layout.sub_block >= layout.sub
    with pytest.raises(ValueError):
        symm_chain.launch_layout(100, 7, 1, world_size)


# ---- the kernels, interpreted on CPU ranks ------------------------------------------------------

ALGORITHMS = {a.name: a for a in (OneShotAllReduce(), TwoShotAllReduce(),
                                  LamportOneShotAllReduce(), LamportTwoShotAllReduce(),
                                  PolledGatherTwoShotAllReduce())}
KINDS = tuple(ALGORITHMS)


def _storage_key(kind, dtype):
    return kind, dtype.itemsize * 8 if ALGORITHMS[kind].lamport else 0


def interpreted_rank(rank, world_size, storages, cases):
    """One rank: every case twice (the second call lands in the other half). Cases follow each
    other on one buffer per kind, so shape changes are covered. A Lamport buffer must be empty
    again once every rank has finished a call: readers empty all they read."""
    import torch.distributed as dist

    from infini_dist.kernels.symm_buffers import EMPTY_PATTERN, from_peer_tensors, header_bytes
    ctx = RunContext(None, world_size, rank, torch.device("cuda"))
    results = []
    for kind, pattern, shape, dtype in cases:
        algorithm = ALGORITHMS[kind]
        graph = build(pattern)
        plan = plan_span(full_span(graph), meta_of(graph, shape, dtype), ctx)
        key = _storage_key(kind, dtype)
        buffer = from_peer_tensors(storages[key], rank)
        assert algorithm.data_bytes(plan, world_size) <= buffer.data_bytes
        for call in range(2):
            inputs = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
            got = algorithm.launch(plan, inputs[rank], buffer)
            error = max_error(got, reference(graph, inputs, rank))
            if kind in ("one_shot_lamport", "two_shot_lamport"):  # every place is polled
                dist.barrier()
                word, bits = EMPTY_PATTERN[key[1]]
                data = storages[key][rank][header_bytes(world_size):].view(word)
                left = int((data != bits).sum())
                error = max(error, float(left))  # a place left full fails the tolerance
                dist.barrier()
            results.append(((kind, pattern, shape, str(dtype), call), error, digest(got)))
    return results


def _run_interpreted(monkeypatch, world_size, cases, data_bytes=1 << 18):
    from infini_dist.kernels.symm_buffers import fill_empty, header_bytes
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # spawned ranks inherit it before importing triton
    storages = {}
    for kind, _, _, dtype in cases:
        key = _storage_key(kind, dtype)
        if key not in storages:
            storages[key] = [torch.zeros(header_bytes(world_size) + data_bytes,
                                         dtype=torch.uint8).share_memory_()
                             for _ in range(world_size)]
            for storage in storages[key] if key[1] else ():
                fill_empty(storage, world_size, key[1])
    per_rank = run_ranks(interpreted_rank, world_size, storages, cases, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    assert all(isinstance(r, list) for r in per_rank), repr(per_rank)[:2000]
    for results in zip(*per_rank):
        case, error, _ = results[0]
        tol = 1e-5 if "float32" in case[3] else 3e-2  # interpreter bf16 rounding truncates
        for rank, (_, err, _) in enumerate(results):
            assert err <= tol, f"{case} rank {rank}: error {err}"
        # Side tensors are the same on every rank, so every output must match bitwise.
        assert len({bits for _, _, bits in results}) == 1, f"{case}: ranks differ"


@pytest.mark.parametrize("kinds", [("one_shot", "two_shot"),
                                   ("one_shot_lamport", "two_shot_lamport"),
                                   ("two_shot_polled_gather",)],
                         ids=["barrier", "lamport", "polled_gather"])
def test_kernels_interpreted_three_ranks(monkeypatch, kinds):
    f32, bf16 = torch.float32, torch.bfloat16
    cases = []
    for kind in kinds:
        for pattern in PATTERNS:
            cases.append((kind, pattern, (3, 40), f32))
        cases += [(kind, "add_rms_norm", (5, 37), f32),   # row not a multiple of the vector
                  (kind, "add_rms_norm", (130, 8), f32),  # more rows than programs
                  (kind, "relu_scale", (3, 333), f32),    # numel not a multiple of anything
                  (kind, "plain", (2, 4100), f32),        # several chunks
                  (kind, "add_rms_norm", (2, 64), bf16),
                  (kind, "swiglu", (3, 40), torch.float16)]
    _run_interpreted(monkeypatch, 3, cases)


def test_kernels_interpreted_eight_ranks(monkeypatch):
    # Tensor parallelism usually runs at 8: every kernel at W = 8 (a bf16 and an fp32 buffer).
    cases = [(kind, pattern, shape, dtype) for kind in KINDS
             for pattern, shape, dtype in (("add_rms_norm", (3, 40), torch.float32),
                                           ("relu_scale", (2, 24), torch.bfloat16))]
    _run_interpreted(monkeypatch, 8, cases, data_bytes=1 << 16)


def test_kernels_interpreted_two_ranks_in_rounds(monkeypatch):
    # One item per program per round: the two-shot runs phase 3 of a round beside phase 2 of
    # the next; with 300 rows on 128 programs some programs go through three rounds.
    monkeypatch.setenv("INFINI_DIST_SYMM_ROUND_ITEMS", "1")
    cases = [(kind, pattern, (3, 48), torch.float32) for kind in ("two_shot", "one_shot")
             for pattern in ("plain", "add_then_rms_norm", "swiglu_up")]
    cases.append(("two_shot", "add_rms_norm", (300, 8), torch.float32))
    _run_interpreted(monkeypatch, 2, cases)


def test_two_shot_interpreted_in_groups_and_rounds(monkeypatch):
    # Items move in groups of 4 (some groups cut short by the end of a round or of the tensor),
    # in rounds of 3 items per program.
    monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", "4")
    monkeypatch.setenv("INFINI_DIST_SYMM_ROUND_ITEMS", "3")
    cases = [(kind, pattern, shape, torch.float32)
             for kind in ("two_shot", "two_shot_polled_gather")
             for pattern, shape in (("add_rms_norm", (300, 8)), ("prologue_gelu", (2, 4100)),
                                    ("add_then_rms_norm", (5, 37)))]
    _run_interpreted(monkeypatch, 2, cases)


# ---- real GPUs ----------------------------------------------------------------------------------

@pytest.mark.multigpu
def test_gpu_worker_under_torchrun(tmp_path):
    gpus = torch.cuda.device_count()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", INFINI_DIST_CACHE_DIR=str(tmp_path / "cache"))
    worker = os.path.join(os.path.dirname(__file__), "gpu_symm_worker.py")
    done = subprocess.run(["timeout", "500", sys.executable, "-m", "torch.distributed.run",
                           f"--nproc-per-node={min(gpus, 4)}", worker, "--quick"],
                          env=env, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ALL OK" in done.stdout
