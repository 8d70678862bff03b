"""kernels/reduce_scatter_all_gather through its engine algorithm (symm_scatter_gather) and as
its plain callable, on Triton-interpreted CPU ranks whose "symmetric" buffers are shared memory
(the callable also on 2 GPUs over NCCL): every output against the unfused reference (the sum
rounded once, scattered, the epilogue, gathered), gathered outputs bitwise equal on every rank,
shapes changing between calls on one buffer. The engine's other algorithm for these spans,
one_shot_scatter_gather, runs beside it wherever it is offered, and must give the same bits
(its plain callable: tests/test_symm_one_shot_scatter_gather.py)."""

from __future__ import annotations

import pytest
import torch

from infini_dist.scheduler.choices import FusedSpan, RunContext, algorithms_for, run_nodes
from infini_dist.scheduler.ir import OpNode, SubGraph
from multirank import run_ranks
from symm_cases import CPU, digest, max_error

F32, BF16 = torch.float32, torch.bfloat16
EPS = {"eps": 1e-5}


def _graph(world: int, pattern: str) -> SubGraph:
    """reduce_scatter(x) -> epilogue on the shard (-> all_gather), as the pass writes them."""
    scatter = OpNode("reduce_scatter", ("x",), ("y",),
                     {"op": "sum", "group_size": world, "group_name": "g"})
    gather = OpNode("all_gather", ("n",), ("g",), {"group_size": world, "group_name": "g"})
    norm = OpNode("add_rms_norm", ("y", "res", "w"), ("n", "s"), EPS)
    if pattern == "norm_gather":  # between two linears: the next layer reads the gathered norm
        return SubGraph((scatter, norm, gather), ("x", "res", "w"), ("s", "g"))
    if pattern == "train_gather":  # a training forward also keeps the rsqrt
        return SubGraph((scatter, norm, OpNode("rms_rstd", ("s",), ("t",), EPS), gather),
                        ("x", "res", "w"), ("s", "t", "g"))
    if pattern == "final_norm":  # the last layer: no gather
        return SubGraph((scatter, norm), ("x", "res", "w"), ("n", "s"))
    fp8_gather = OpNode("all_gather", ("q",), ("g",), {"group_size": world, "group_name": "g"})
    if pattern == "fp8_gather":  # FP8 rows gathered, the residual kept in the input dtype
        quant = OpNode("quant_fp8_per_token", ("n",), ("q", "qs"))
        return SubGraph((scatter, norm, quant, fp8_gather), ("x", "res", "w"), ("s", "qs", "g"))
    if pattern == "static_fp8_gather":  # one scale for all rows: no per-row side output
        quant = OpNode("quant_fp8", ("n",), ("q",), {"scale": 0.02})
        return SubGraph((scatter, norm, quant, fp8_gather), ("x", "res", "w"), ("s", "g"))
    if pattern == "side_gather":  # a chain step reading another shard-shaped tensor
        side = OpNode("mul", ("y", "m"), ("ym",))
        norm = OpNode("add_rms_norm", ("ym", "res", "w"), ("n", "s"), EPS)
        return SubGraph((scatter, side, norm, gather), ("x", "m", "res", "w"), ("s", "g"))
    assert pattern == "backward"  # a norm's backward after the gradient's reduce_scatter
    return SubGraph((scatter, OpNode("mul", ("y", "res"), ("a",)),
                     OpNode("mul", ("y", "w"), ("b",))), ("x", "res", "w"), ("a", "b"))


def _inputs(graph, world, shape, dtype, rank, call) -> dict:
    shard = (shape[0] // world,) + tuple(shape[1:])
    values = {}
    for index, name in enumerate(graph.input_names):
        # Every rank's own x and shards (a row's owner shows); one weight, as SP replicates it.
        seed = 50 + index if name == "w" else 60 + 10 * rank + index
        gen = torch.Generator().manual_seed(1000 * call + (rank + 1 if name == "x" else seed))
        size = shape if name == "x" else (shape[-1],) if name == "w" and "rms" in str(
            graph.nodes) else shard
        t = torch.randn(size, generator=gen)
        values[name] = (0.5 + t.abs() if name == "w" and size == (shape[-1],) else t).to(dtype)
    return values


def _epilogue(graph) -> range:
    return range(1, len(graph.nodes) - (graph.nodes[-1].op_type == "all_gather"))


def _finish(graph, envs: list) -> None:
    """Each rank's epilogue on its shard `y`, then the gather (every rank's value, in order)."""
    for env in envs:
        run_nodes(graph, _epilogue(graph), env, CPU)
    if graph.nodes[-1].op_type == "all_gather":
        gathered = torch.cat([env[graph.nodes[-1].inputs[0]] for env in envs])
        for env in envs:
            env["g"] = gathered


def _reference(graph, inputs_per_rank, rank, world) -> dict:
    """The sum in fp64, rounded once to the dtype like the reduce_scatter, then unfused."""
    total = sum(v["x"].double() for v in inputs_per_rank).to(inputs_per_rank[0]["x"].dtype)
    envs = [dict(inputs_per_rank[r], y=total.chunk(world)[r]) for r in range(world)]
    _finish(graph, envs)
    return {n: envs[rank][n] for n in graph.output_names}


def _meta(graph, world, shape, dtype) -> dict:
    """TensorMeta of every value (device "cuda", which plans need) from one CPU pass."""
    from infini_dist.scheduler.choices import TensorMeta
    inputs = _inputs(graph, world, shape, dtype, 0, 0)
    envs = [dict(inputs, y=inputs["x"].chunk(world)[0].clone()) for _ in range(world)]
    _finish(graph, envs)
    return {n: TensorMeta(tuple(v.shape), v.dtype, torch.device("cuda"), True)
            for n, v in envs[0].items()}


CASES = [("norm_gather", (6, 40), F32), ("train_gather", (4, 3, 64), F32),
         ("final_norm", (6, 40), F32),
         ("norm_gather", (258, 8), F32),   # more shard rows than programs
         ("norm_gather", (4, 64), BF16), ("fp8_gather", (6, 40), BF16),
         ("static_fp8_gather", (6, 40), BF16), ("side_gather", (6, 40), F32)]
# At 3 ranks, the cases whose layout depends on the world size (shard rows, a gathered row
# per rank, more rows than programs); dtypes and quantizers are the same code at any size.
ODD_WORLD_CASES = [case for case in CASES if case[2] is F32 and case[0] != "side_gather"]
# The patterns one_shot_scatter_gather runs: it gathers, and has no other rank's per-row side
# data (a per-row quantizer's scales, a shard-shaped chain operand).
ONE_SHOT = {"norm_gather", "train_gather", "static_fp8_gather"}


def scatter_rank(rank, world, storages, cases):
    """Each case twice through every registered algorithm that offers it, by a plain launch
    and by the engine's runner, each kind on its own buffer: (case, call, path, algorithm),
    error, digest of the gathered value, digest of every output, per call; and per case the
    algorithms that offered it."""
    import infini_dist
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    from infini_dist.scheduler.backends.symm_launch import tuning_of
    from infini_dist.scheduler.backends import symm_scatter
    ctx = RunContext(None, world, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    algorithms = algorithms_for("reduce_scatter", "cuda")
    buffers = {kind: from_peer_tensors(s, rank) for kind, s in storages.items()}
    # The engine's runner (compile -> first call -> bound launches) on these buffers: no CUDA
    # warm-up, and the buffer of its kind in place of the symmetric one its first call would
    # allocate.
    symm_scatter.warm_up = lambda algorithm, plan, names, meta, ctx: (
        algorithm.data_bytes(plan, ctx.world_size), tuning_of(ctx.settings), True)
    symm_scatter.symm_buffers.get_buffer = lambda group, device, kind, *_: buffers[kind]
    results, offered = [], []
    for pattern, shape, dtype in cases:
        shape = (shape[0] * world // 2,) + tuple(shape[1:])  # the same shard rows per rank
        graph = _graph(world, pattern)
        span = FusedSpan(graph, (), (0,), tuple(range(1, len(graph.nodes))))
        meta = _meta(graph, world, shape, dtype)
        runs = [a for a in algorithms if a.supports(span, meta, ctx)]
        offered.append((pattern, [a.name for a in runs]))
        for algorithm in runs:
            plan = algorithm.plan(span, meta, ctx)
            buffer = buffers[algorithm.module.KIND]
            assert algorithm.data_bytes(plan, world) <= buffer.data_bytes
            run = algorithm.compile(span, meta, ctx)
            for call in range(2):
                inputs = [_inputs(graph, world, shape, dtype, r, call) for r in range(world)]
                expected = _reference(graph, inputs, rank, world)
                for path, got in (("launch", algorithm.launch(plan, inputs[rank], buffer,
                                                              tuning_of(ctx.settings))),
                                  ("runner", run(inputs[rank]))):
                    gathered = {n: v for n, v in got.items() if n == "g"}
                    results.append(((pattern, shape, str(dtype), call, path, algorithm.name),
                                    max_error(got, expected), digest(gathered), digest(got)))
    return results, offered


# The kernel files, named as their callables and their buffers' KIND
KINDS = ("reduce_scatter_all_gather", "one_shot_scatter_gather")


def shared_storages(world: int) -> dict:
    """Every kind's "symmetric" buffers on `world` interpreted ranks: shared CPU memory."""
    from infini_dist.kernels.symm_buffers import header_bytes
    return {kind: [torch.zeros(header_bytes(world) + (1 << 18), dtype=torch.uint8).share_memory_()
                   for _ in range(world)] for kind in KINDS}


@pytest.mark.parametrize("world", [2, 3])
def test_interpreted(monkeypatch, world):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    per_rank = run_ranks(scatter_rank, world, shared_storages(world),
                         CASES if world == 2 else ODD_WORLD_CASES, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    assert all(isinstance(r, tuple) for r in per_rank), repr(per_rank)[:2000]
    for pattern, names in per_rank[0][1]:
        assert names == ["symm_scatter_gather"] + ["one_shot_scatter_gather"] * (
            pattern in ONE_SHOT), (pattern, names)
    for results in zip(*(results for results, _ in per_rank)):
        case = results[0][0]
        tol = 1e-5 if "float32" in case[2] else 3e-2
        for rank, (_, error, _, _) in enumerate(results):
            assert error <= tol, f"{case} rank {rank}: error {error}"
        assert len({bits for _, _, bits, _ in results}) == 1, f"{case}: gathered outputs differ"
    for rank, (results, _) in enumerate(per_rank):  # every algorithm and path: the same bits
        outputs = {}
        for case, _, _, bits in results:
            outputs.setdefault(case[:4], set()).add(bits)
        for case, bits in outputs.items():
            assert len(bits) == 1, f"{case} rank {rank}: algorithms or paths differ"


def test_plan_rejects_what_the_kernel_cannot_run():
    from infini_dist.scheduler.backends.symm_scatter import plan_scatter
    ctx = RunContext(None, 2, 0, torch.device("cuda"))
    graph = _graph(2, "norm_gather")
    meta = _meta(graph, 2, (4, 40), F32)
    span = FusedSpan(graph, (), (0,), (1, 2))
    assert plan_scatter(span, meta, ctx) is not None
    assert plan_scatter(span, meta, RunContext(None, 2, 0, torch.device("cpu"))) is None
    assert plan_scatter(span, meta, RunContext(None, 4, 0, torch.device("cuda"))) is None  # size
    assert plan_scatter(span, _meta(graph, 2, (4, 32769), F32), ctx) is None  # a row too long
    other = SubGraph(graph.nodes[:2] + (OpNode("all_gather", ("n",), ("g",), {
        "group_size": 2, "group_name": "other"}),), graph.input_names, graph.output_names)
    assert plan_scatter(FusedSpan(other, (), (0,), (1, 2)), meta, ctx) is None
    # Two ops reading the shard (a norm's backward): the chain is one line; native runs it.
    backward = _graph(2, "backward")
    assert plan_scatter(FusedSpan(backward, (), (0,), (1, 2)),
                        _meta(backward, 2, (4, 40), F32), ctx) is None


def compile_for_gpu(name, pattern, dtype):
    """In the compile worker: algorithm `name`'s kernel as the engine launches `pattern`,
    compiled for sm_90."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    shape = (8, 256)
    graph = _graph(2, pattern)
    span = FusedSpan(graph, (), (0,), tuple(range(1, len(graph.nodes))))
    (algorithm,) = [a for a in algorithms_for("reduce_scatter", "cuda") if a.name == name]
    plan = algorithm.plan(span, _meta(graph, 2, shape, dtype), RunContext(
        None, 2, 0, torch.device("cuda")))
    tensors = _inputs(graph, 2, shape, dtype, 0, 0)
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 20), dtype=torch.uint8)
                                for _ in range(2)], 0)
    written, gathered = algorithm._outputs(plan, torch.device("cpu"))
    jit, grid, args, kwargs = algorithm.arguments(plan, tensors, buffer, written, gathered)
    return sorted(jit.warmup(*args, grid=grid, **kwargs).asm)


def test_compiles_for_sm90(tmp_path):
    """The interpreter compiles nothing: the GPU compiler (sm_90, to a cubin) must take it too."""
    pytest.importorskip("triton.backends.nvidia")
    from launch_stub import compile_pool
    cases = [("symm_scatter_gather", "train_gather", BF16),
             ("symm_scatter_gather", "fp8_gather", BF16),
             ("symm_scatter_gather", "final_norm", F32),
             ("one_shot_scatter_gather", "train_gather", BF16),
             ("one_shot_scatter_gather", "static_fp8_gather", BF16)]
    with compile_pool(str(tmp_path / "home")) as pool:
        for case in cases:
            assert "cubin" in pool.submit(compile_for_gpu, *case).result(timeout=600), case


# ---- the plain callable: reduce_scatter -> add + RMSNorm (-> all_gather) -------------------------

# (shard shape, dtype): x is [W * shard[0], ...] on every rank
CALLABLE_CASES = [((3, 40), F32), ((2, 64), BF16), ((2, 3, 16), F32)]
GPU_CALLABLE_CASES = CALLABLE_CASES + [((130, 8), BF16), ((64, 4096), BF16), ((5, 1000), F32)]
CALLABLE_EPS = 1e-5


def _callable_inputs(world, shard, dtype, call):
    """Every rank's x [W * n, ...] and residual shard, and the weight: random, none zero."""
    def randn(shape, seed):
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return (t.sign() * (0.05 + t.abs())).to(dtype)  # no zeros: a dropped value shows
    full = (world * shard[0],) + tuple(shard[1:])
    xs = [randn(full, 100 * call + r) for r in range(world)]
    residuals = [randn(shard, 100 * call + 50 + r) for r in range(world)]
    weight = (0.5 + randn(shard[-1:], 100 * call + 99).double().abs()).to(dtype)
    return xs, residuals, weight


def _callable_reference(xs, residuals, weight, world):
    """The unfused equivalent in float64: reduce_scatter_tensor (its output rounded to the
    dtype), residual add and RMSNorm, all_gather_into_tensor; (gathered out, new residuals)."""
    dtype = xs[0].dtype
    total = sum(x.double() for x in xs).to(dtype).double()
    outs, pres = [], []
    for shard, residual in zip(total.chunk(world), residuals):
        pre = shard + residual.double()
        rstd = torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + CALLABLE_EPS)
        outs.append((pre * rstd * weight.double()).to(dtype))
        pres.append(pre.to(dtype))
    return torch.cat(outs), pres


def callable_rank(rank, world, storages, device, cases):
    """Each case twice (new inputs), gathered and not, through the plain callable on one buffer
    (the shared CPU `storages`, or with None the callable's own symmetric buffer on CUDA): per
    call (case, error, digest of the gathered value, this rank's shard of `out`)."""
    from infini_dist.kernels.reduce_scatter_all_gather import reduce_scatter_all_gather
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    buffer = from_peer_tensors(storages, rank) if storages is not None else None
    results = []
    for shard, dtype in cases:
        for call in range(2):
            xs, residuals, weight = _callable_inputs(world, shard, dtype, call)
            out, pres = _callable_reference(xs, residuals, weight, world)
            for gather in (True, False):
                got, residual = reduce_scatter_all_gather(
                    xs[rank].to(device), weight=weight.to(device),
                    residual=residuals[rank].to(device), eps=CALLABLE_EPS, gather=gather,
                    buffer=buffer)
                want = out if gather else out.chunk(world)[rank]
                error = max_error({"out": got, "residual": residual},
                                  {"out": want, "residual": pres[rank]})
                mine = got.chunk(world)[rank] if gather else got
                results.append(((shard, str(dtype), call, gather), error,
                                digest({"out": got}) if gather else None, mine.cpu()))
    return results


def _check_callable(per_rank, world):
    assert all(isinstance(r, list) for r in per_rank), repr(per_rank)[:2000]
    shards = {}
    for results in zip(*per_rank):
        (shard, dtype, call, gather), _, _, _ = results[0]
        tol = 1e-5 if "float32" in dtype else 3e-2
        for rank, (case, error, _, _) in enumerate(results):
            assert error <= tol, f"{case} rank {rank}: error {error}"
        if gather:
            assert len({bits for _, _, bits, _ in results}) == 1, f"{results[0][0]}: ranks differ"
        # The same sums whether gathered or not: every rank's shard, to the bit.
        shards.setdefault((shard, dtype, call), []).append([mine for *_, mine in results])
    for case, (gathered, scattered) in shards.items():
        for rank in range(world):
            assert torch.equal(gathered[rank].view(torch.uint8),
                               scattered[rank].view(torch.uint8)), (case, rank)


@pytest.mark.parametrize("kernel, x, options, message", [
    *((k, torch.randn(3, 8), {}, "split evenly over 2 ranks") for k in KINDS),
    *((k, torch.randn(4, 8), {"weight": torch.ones(8), "residual": torch.randn(4, 8)},
       "residual must be a tensor of shape (2, 8)") for k in KINDS),  # a shard's, not x's
    *((k, torch.randn(4, 8), {"epilogue": (("mul", torch.randn(4, 8)),)}, "shape (2, 8)")
      for k in KINDS),
    *((k, torch.randn(2, 40000), {}, "rows of at most") for k in KINDS),
    *((k, torch.randn(512, 512), {}, "this call needs") for k in KINDS),
    ("reduce_scatter_all_gather", torch.randn(4, 8), {"quant": ("quant_fp8_per_token",)},
     "needs a norm"),
    # what the one-shot leaves to reduce_scatter_all_gather: other ranks' per-row side data
    ("one_shot_scatter_gather", torch.randn(4, 8), {"weight": torch.ones(8), "quant": (
        "quant_fp8_per_token",)}, "a per-row quantizer's scales"),
    ("one_shot_scatter_gather", torch.randn(4, 8), {"epilogue": (("mul", torch.randn(2, 8)),)},
     "shard-shaped operand"),
])
def test_callable_refuses_bad_input(kernel, x, options, message):
    """Before anything is launched: the launch builder's checks included."""
    import importlib
    import re

    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    function = getattr(importlib.import_module(f"infini_dist.kernels.{kernel}"), kernel)
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 20), dtype=torch.uint8)
                                for _ in range(2)], 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        function(x, buffer=buffer, **options)


@pytest.mark.parametrize("world", [2, 3])
def test_callable_interpreted(monkeypatch, world):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from infini_dist.kernels.symm_buffers import header_bytes
    storages = [torch.zeros(header_bytes(world) + (1 << 18), dtype=torch.uint8).share_memory_()
                for _ in range(world)]
    per_rank = run_ranks(callable_rank, world, storages, "cpu", CALLABLE_CASES, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    _check_callable(per_rank, world)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_callable_on_gpus():
    """The callable on 2 GPUs over NCCL, its symmetric buffer its own (allocated on first use)."""
    from multirank import SAFE_GPU_ENV
    per_rank = run_ranks(callable_rank, 2, None, "cuda", GPU_CALLABLE_CASES, backend="nccl",
                         env=SAFE_GPU_ENV, timeout=540)
    _check_callable(per_rank, 2)
