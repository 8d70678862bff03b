"""`nccl+nt_epilogue` on the CPU: which spans it takes (supports() is pure Python, checked in
process with CUDA metadata), and its runner on 2 gloo ranks with the kernel run by Triton's
interpreter (in fresh rank processes, each with its own HOME for ninetoothed's cache): called
directly, and as choices the engine tunes, checks against the fp32 reference and across ranks."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from infini_dist.kernels.chain import UnsupportedChain
from infini_dist.scheduler.backends.nccl_epilogue import NcclEpilogueAlgorithm, plan
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta, run_nodes
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.boundary import find_sites
from interpreter_worker import interpreter_unusable
from multirank import run_ranks
from symm_cases import fp8_error

CUDA = torch.device("cuda")
GPU_CTX = RunContext(None, 2, 0, CUDA)


def N(op, *names, **attrs):
    """N("add", "a", "b", "c") is c = add(a, b); several outputs go in a tuple."""
    *inputs, outputs = names
    return OpNode(op, tuple(inputs), (outputs,) if isinstance(outputs, str) else tuple(outputs),
                  attrs)


def _cube(x):
    return x * x * x


op_registry.register_op("test_nccl_epilogue_cube", _cube, kind="elementwise", num_inputs=1)

# name: (nodes, graph inputs, graph outputs); "x" is every all_reduce's input.
GRAPHS = {
    "add_rms_norm_pair": ([N("all_reduce", "x", "y"), N("add", "y", "res", "h"),
                           N("rms_norm", "h", "w", "out", eps=1e-5)],
                          ["x", "res", "w"], ["out", "h"]),
    "add_rms_norm": ([N("all_reduce", "x", "y"), N("add_rms_norm", "y", "res", "w", ("out", "h"))],
                     ["x", "res", "w"], ["out", "h"]),
    "relu_scale": ([N("all_reduce", "x", "y"), N("relu", "y", "r"),
                    N("scale", "r", "out", scale=0.125)], ["x"], ["out"]),
    "swiglu": ([N("all_reduce", "x", "y"), N("swiglu", "y", "up", "out")], ["x", "up"], ["out"]),
    "reduced_also_read": ([N("all_reduce", "x", "y"), N("gelu", "y", "g"),
                           N("mul", "g", "y", "out")], ["x"], ["out", "y"]),
    "custom_op": ([N("all_reduce", "x", "y"), N("test_nccl_epilogue_cube", "y", "out")],
                  ["x"], ["out"]),
    # an FP8 output and a per-row one (the fp32 scales, rows x 1) beside the residual sum
    "add_rms_norm_fp8_token": ([N("all_reduce", "x", "y"),
                                N("add_rms_norm", "y", "res", "w", ("n", "h"), eps=1e-5),
                                N("quant_fp8_per_token", "n", ("out", "scales"))],
                               ["x", "res", "w"], ["out", "scales", "h"]),
}


def tensors_for(name, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cols = shape[-1]
    values = {"x": torch.randn(shape, generator=g).to(dtype),
              "res": torch.randn(shape, generator=g).to(dtype),
              "up": torch.randn(shape, generator=g).to(dtype),
              "w": torch.randn((cols,), generator=g)}
    return {n: values[n] for n in GRAPHS[name][1]}


def span_and_meta(name, shape=(3, 37), dtype=torch.bfloat16, depth=None, device=CUDA):
    """The span of the graph's first site with `depth` epilogue nodes (all by default), and
    metadata for every value as the engine would record it, placed on `device`."""
    nodes, inputs, outputs = GRAPHS[name]
    graph = SubGraph(tuple(nodes), tuple(inputs), tuple(outputs))
    site = find_sites(graph)[0]
    epilogue = site.epilogue if depth is None else site.epilogue[:depth]
    span = FusedSpan(graph, (), site.anchors, epilogue)
    env = tensors_for(name, shape, dtype)
    for node in nodes:  # the reduction itself does not change shapes or dtypes
        values = ([env[node.inputs[0]].clone()] if node.op_type == "all_reduce" else
                  op_registry.run_node(node.op_type, [env[n] for n in node.inputs], node.attr_dict))
        env.update(zip(node.outputs, values))
    meta = {n: TensorMeta(tuple(v.shape), v.dtype, device, v.is_contiguous())
            for n, v in env.items()}
    return span, meta


def supports(span, meta, ctx=GPU_CTX):
    return NcclEpilogueAlgorithm().supports(span, meta, ctx)


@pytest.mark.parametrize("name", ["add_rms_norm_pair", "add_rms_norm", "relu_scale", "swiglu",
                                  "reduced_also_read", "add_rms_norm_fp8_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_supports_epilogue_chains(name, dtype):
    span, meta = span_and_meta(name, dtype=dtype)
    assert supports(span, meta)
    if len(span.epilogue) > 1:  # every shorter depth is a chain too
        assert supports(*span_and_meta(name, dtype=dtype, depth=1))


def test_refuses_what_it_cannot_run():
    assert not supports(*span_and_meta("relu_scale", depth=0))  # that is native itself
    assert not supports(*span_and_meta("custom_op"))  # no kernel for a user's op
    for dtype in (torch.float64, torch.int32):
        assert not supports(*span_and_meta("relu_scale", dtype=dtype))
    span, meta = span_and_meta("relu_scale", device=torch.device("cpu"))
    assert not supports(span, meta, RunContext(None, 2, 0, torch.device("cpu")))
    assert not supports(span, meta)  # CUDA context, CPU tensors
    # A row too long for one tile stops the norms, not the elementwise chains.
    assert not supports(*span_and_meta("add_rms_norm", shape=(1, 70000)))
    assert supports(*span_and_meta("relu_scale", shape=(1, 70000)))


def test_refuses_bad_shapes_and_prologues():
    span, meta = span_and_meta("add_rms_norm")
    meta["w"] = meta["w"]._replace(shape=(36,))
    assert not supports(span, meta)
    span, meta = span_and_meta("swiglu")
    meta["up"] = meta["up"]._replace(shape=(2, 3, 37))  # would grow the result
    assert not supports(span, meta)
    span, meta = span_and_meta("relu_scale")
    with_prologue = FusedSpan(span.graph, (1,), span.anchors, span.epilogue)
    assert not supports(with_prologue, meta)
    graph = SubGraph((N("all_reduce", "x", "z", ("y", "y2")), N("relu", "y", "out")),
                     ("x", "z"), ("out", "y2"))
    meta = {n: TensorMeta((3, 37), torch.float32, CUDA, True) for n in ("x", "z", "y", "y2", "out")}
    assert not supports(FusedSpan(graph, (), (0,), (1,)), meta)  # coalesced


def test_plan_reuses_the_reduced_buffer_only_when_it_is_not_an_output():
    p = plan(*span_and_meta("add_rms_norm_pair"))
    assert p.chain_inputs == ("y", "res", "w") and p.chain_outputs == ("h", "out")
    assert p.in_place == 0 and not p.returns_reduced
    p = plan(*span_and_meta("reduced_also_read"))
    assert p.returns_reduced and p.in_place is None and p.chain_outputs == ("out",)
    p = plan(*span_and_meta("add_rms_norm_fp8_token", dtype=torch.float32))
    assert p.chain_outputs == ("h", "out", "scales") and p.in_place == 0  # not the fp32 scales


# ---- the runner on 2 gloo ranks, kernels interpreted ---------------------------------------------

RUN_CASES = [("add_rms_norm_pair", torch.bfloat16, (2, 3, 37)),
             ("add_rms_norm", torch.float32, (4, 64)),
             ("relu_scale", torch.float32, (5, 37)),
             ("reduced_also_read", torch.bfloat16, (3, 37)),
             ("add_rms_norm_fp8_token", torch.bfloat16, (2, 3, 37))]


def _digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank_runs(rank, world_size, home):
    """Per case and output: (close to the fp32 reference, digest of the bits). Plain data only:
    tensors sent from a process that then exits cannot be received."""
    os.environ["HOME"] = os.path.join(home, f"rank{rank}")  # ninetoothed's cache, per process
    os.makedirs(os.environ["HOME"], exist_ok=True)
    ctx = RunContext(None, world_size, rank, torch.device("cpu"))
    results = {}
    for name, dtype, shape in RUN_CASES:
        span, meta = span_and_meta(name, shape, dtype, device=torch.device("cpu"))
        runner = NcclEpilogueAlgorithm().compile(span, meta, ctx)
        inputs = tensors_for(name, shape, dtype)
        inputs["x"] = inputs["x"] * (rank + 1) + rank  # each rank contributes its own values
        before = inputs["x"].clone()
        got = runner(dict(inputs))
        env = dict(inputs)
        run_nodes(span.graph, span.indices, env, ctx)  # the fp32 reference
        results[name] = {
            "outputs": sorted(got), "expected": sorted(span.outputs),
            "input_untouched": torch.equal(before, inputs["x"]),
            "close": {n: _close(got[n], env[n], dtype) for n in span.outputs if n in got},
            "digests": {n: _digest(t) for n, t in got.items()}}
    results["engine"] = _through_the_engine(rank)
    return results


def _close(got, expected, dtype):
    """As the engine checks a choice (an fp32 output of bf16 inputs, the per-token scales, with
    bf16's tolerance); FP8 values within one e4m3 step, as the symm tests check them."""
    if expected.dtype == torch.float8_e4m3fn:
        return fp8_error(got.double(), expected.double()) == 0
    return op_registry.close_enough(got, expected, computed_in=dtype)


class _CpuNcclEpilogue(NcclEpilogueAlgorithm):
    """The same algorithm, allowed on CPU tensors (gloo reduces, the interpreter runs kernels)."""

    def supports(self, span, meta, ctx):
        try:
            plan(span, meta)
        except UnsupportedChain:
            return False
        return True


def _through_the_engine(rank):
    """Tune a site with the engine: every choice of ours must pass its checks (against the
    fp32 reference, and bitwise across ranks) and survive as a candidate."""
    import infini_dist
    from infini_dist.scheduler.choices import register_algorithm
    from infini_dist.scheduler.engine import executor_for
    register_algorithm("all_reduce", "cpu", _CpuNcclEpilogue())
    nodes, inputs, outputs = GRAPHS["add_rms_norm_pair"]
    graph = SubGraph(tuple(nodes), tuple(inputs), tuple(outputs))
    values = tensors_for("add_rms_norm_pair", (3, 37), torch.bfloat16)
    values["x"] = values["x"] * (rank + 1)
    with infini_dist.config.patch(benchmark_warmup=0, benchmark_reps=1, enable_disk_cache=False):
        executor = executor_for(graph, infini_dist.config.snapshot())
        executor.run(values)
        return executor.site_runners()[0].last_tuning["candidates"]


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_runner_on_two_gloo_ranks(tmp_path):
    per_rank = run_ranks(_rank_runs, 2, str(tmp_path), env={"TRITON_INTERPRET": "1"},
                         timeout=300)
    for name, _, _ in RUN_CASES:
        for rank in range(2):
            result = per_rank[rank][name]
            assert result["input_untouched"], name
            assert result["outputs"] == result["expected"], name
            assert all(result["close"].values()), (name, rank, result["close"])
        assert per_rank[0][name]["digests"] == per_rank[1][name]["digests"], name
    ours = [c for c in per_rank[0]["engine"] if c.startswith("nccl+nt_epilogue")]
    assert ours == ["nccl+nt_epilogue[p0,e1]", "nccl+nt_epilogue[p0,e2]"], per_rank[0]["engine"]
    assert per_rank[0]["engine"] == per_rank[1]["engine"]
