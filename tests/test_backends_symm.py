"""The engine's symmetric-memory algorithms (scheduler/backends/symm.py): span planning (what
`supports` accepts), chain encoding, launch layouts, and every registered kernel at 8 interpreted
ranks, and the engine choosing among them on GPUs (tests/gpu_symm_worker.py under torchrun).
Each kernel's own tests, on GPUs too: tests/test_symm_<kernel file>.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

import infini_dist
from infini_dist.kernels import symm_chain
from infini_dist.kernels.one_shot_all_reduce import one_shot_all_reduce
from infini_dist.kernels.two_shot_all_reduce import two_shot_all_reduce
from infini_dist.scheduler.backends.symm import plan_span
from infini_dist.scheduler.backends.symm_launch import tuning_of
from infini_dist.scheduler.choices import FusedSpan, RunContext, TensorMeta, generate_choices
from infini_dist.scheduler.ir import OpNode, SubGraph
from infini_dist.scheduler.boundary import find_sites
from symm_cases import PATTERNS, RSTD, TRAIN, build, full_span, meta_of
from symm_runs import algorithm_of, run_gpu_worker, run_interpreted, symm_algorithms

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
        assert algorithm_of(one_shot_all_reduce).supports(span, meta, CUDA4)
        assert algorithm_of(two_shot_all_reduce).supports(span, meta, CUDA4)


def test_plan_of_add_rms_norm_names_both_outputs():
    graph = build("add_rms_norm")
    plan = plan_span(full_span(graph), meta_of(graph, (4, 64), torch.bfloat16), CUDA4)
    assert (plan.norm, plan.out, plan.pre, plan.residual, plan.weight, plan.eps) == (
        symm_chain.NORM_CODES["add_rms_norm"], "n", "r", "res", "w", 1e-5)
    plan = plan_span(full_span(build("prologue_norm")),
                     meta_of(build("prologue_norm"), (4, 64), torch.float16), CUDA4)
    assert plan.residual == "res" and [op.code for op in plan.prologue] == [
        symm_chain.CODES["relu"]]
    assert [op.code for op in plan.epilogue] == [symm_chain.CODES["gelu"]]


def test_training_site_gets_every_symm_kernel_at_full_depth():
    """A training forward's site: add + RMSNorm with its rsqrt (rms_rstd) and the all_reduce's
    own value read too. Every symmetric-memory kernel is a choice at every epilogue depth, the
    full one (all written by one launch) included; so is the rsqrt of an rms_norm alone."""
    for pattern in (TRAIN, "rms_norm+rstd", "add_then_gemma_rms_norm+rstd"):
        graph = build(pattern)
        site = find_sites(graph)[0]
        choices = generate_choices(graph, site, meta_of(graph, (16, 64), torch.bfloat16), CUDA4,
                                   fusion_types=("epilogue",), max_depth=5, recursive=True)
        full = {c.algorithm.name for c in choices
                if c.span is not None and c.span.epilogue == site.epilogue}
        assert full >= set(symm_algorithms()), (pattern, sorted(c.name for c in choices))
        plan = plan_span(full_span(graph), meta_of(graph, (16, 64), torch.bfloat16), CUDA4)
        assert plan.rstd == "t" and set(plan.outputs) == set(graph.output_names)
    assert (plan.reduced, plan_span(full_span(build(TRAIN)), meta_of(
        build(TRAIN), (4, 64), torch.float32), CUDA4).reduced) == (None, "y")


def test_streamed_one_shot_is_capped_by_its_buffer():
    """Its buffer holds 2 W copies of the tensor: 64 MiB of bf16 rows are offered at 2 ranks
    (256 MiB of buffer) and not at 4; 16 MiB at 8 ranks, not 32 MiB. The two-shot's cap is the
    tensor's, whatever the world size."""
    from infini_dist.kernels.lamport_one_shot_streamed import \
        lamport_one_shot_streamed_all_reduce as streamed
    graph = build("add_rms_norm")
    span = full_span(graph)

    def offered(kernel, world_size, tokens):
        ctx = RunContext(None, world_size, 1, torch.device("cuda", 1))
        meta = meta_of(graph, (tokens, 4096), torch.bfloat16)
        return algorithm_of(kernel).supports(span, meta, ctx)
    assert offered(streamed, 2, 8192) and not offered(streamed, 4, 8192)
    assert offered(streamed, 8, 2048) and not offered(streamed, 8, 4096)
    assert offered(two_shot_all_reduce, 8, 8192)


def test_plan_writes_only_the_rsqrt_the_norm_uses():
    ar = OpNode("all_reduce", ("x",), ("y",))
    norm = OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r"), {"eps": 1e-5})

    def rstd(value, eps=1e-5):
        return OpNode(RSTD, (value,), ("t",), {"eps": eps})
    meta = dict(_meta(), t=TensorMeta((4, 1), torch.float32, torch.device("cuda"), True))
    cases = {
        "another eps": ([ar, norm, rstd("r", 1e-6)], ["n", "t"]),
        "of the reduced value, not the norm's input": ([ar, norm, rstd("y")], ["n", "t"]),
        "after a LayerNorm": ([ar, OpNode("layer_norm", ("y", "w", "b"), ("n",)), rstd("y")],
                              ["n", "t"]),
        "with no norm": ([ar, rstd("y")], ["t"]),
    }
    for why, (nodes, outputs) in cases.items():
        _, span = _span(nodes, ["x", "res", "w", "b"], outputs)
        assert plan_span(span, dict(meta, b=meta["w"]), CUDA4) is None, why
    _, span = _span([ar, norm, rstd("r")], ["x", "res", "w"], ["n", "t"])
    assert plan_span(span, meta, CUDA4).writes == ("out", "rstd")
    with pytest.raises(ValueError):  # the kernels refuse it too
        symm_chain.fused_arguments(torch.ones(4, 8), _Buffer(), torch.ones(4, 8),
                                   norm=symm_chain.NORM_CODES["layer_norm"], row_len=8,
                                   rstd=torch.ones(4, 1))


class _Buffer:
    world_size = 2


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
    assert plan_span(span, _meta(up=((1, 64), torch.bfloat16)), CUDA4) is None, "broadcast side"
    assert plan_span(span, _meta(up=((64,), torch.float32)), CUDA4) is None, "mixed-dtype bias"
    bias = plan_span(span, _meta(up=((64,), torch.bfloat16)), CUDA4)  # a bias: one per column
    assert bias.epilogue == (symm_chain.ChainOp(symm_chain.CODES["bias_add"], 64.0, "up"),)
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
    assert not algorithm_of(one_shot_all_reduce).supports(span, big, CUDA4)
    assert algorithm_of(two_shot_all_reduce).supports(span, big, CUDA4)


def test_encode_node_covers_the_elementwise_ops():
    enc = symm_chain.encode_node
    assert enc(OpNode("gelu", ("y",), ("a",), {"approximate": "tanh"}), "y").code == \
        symm_chain.CODES["gelu_tanh"]
    assert enc(OpNode("gelu", ("y",), ("a",), {"approximate": "bogus"}), "y") is None
    assert enc(OpNode("scale", ("y",), ("a",), {"scale": 3}), "y").scalar == 3.0
    assert enc(OpNode("swiglu", ("y", "u"), ("a",)), "y") == symm_chain.ChainOp(
        symm_chain.CODES["swiglu_gate"], 0.0, "u")
    assert enc(OpNode("swiglu", ("g", "y"), ("a",)), "y").code == symm_chain.CODES["swiglu_up"]
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


def test_launch_knobs_reach_every_kernel_launch(monkeypatch):
    """infini_dist.config's symm_* settings, as the engine passes them (tuning_of), shape the
    launch: the timeout every kernel is handed, two-shot groups and rounds, the Lamport
    kernels' preload, programmatic dependent launch."""
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    from infini_dist.kernels.symm_device import DEFAULT_TUNING
    with infini_dist.config.patch(symm_timeout_s=7.5, symm_group_items=3, symm_round_items=5,
                                  symm_preload=False, symm_pdl=False):
        tuning = tuning_of(infini_dist.config.snapshot())
    assert tuning_of(None) == DEFAULT_TUNING and (DEFAULT_TUNING.pdl, tuning.pdl) == (True, False)
    graph, shape = build("add_rms_norm"), (3, 40)
    plan = plan_span(full_span(graph), meta_of(graph, shape, torch.float32), CUDA4)
    buffer = from_peer_tensors([torch.zeros(header_bytes(4) + (1 << 16), dtype=torch.uint8)
                                for _ in range(4)], 1)
    tensors = {name: torch.ones(meta.shape) for name, meta in meta_of(graph, shape,
                                                                        torch.float32).items()}
    x, written = tensors[plan.source], plan.allocate(torch.device("cpu"))
    for name, algorithm in sorted(symm_algorithms().items()):
        monkeypatch.setattr(sys.modules[algorithm.kernel.launch.__module__], "pdl_options",
                            lambda tuning, x: {"PDL": True, "launch_pdl": True} if tuning.pdl
                            else {})
        (_, _, default, default_kw), (_, _, tuned, tuned_kw) = (
            algorithm.launch_arguments(plan, x, tensors, buffer, written, t)
            for t in (DEFAULT_TUNING, tuning))
        ints = [[a for a in args if type(a) is int] for args in (default, tuned)]
        assert 300 * 10 ** 9 in ints[0] and 7_500_000_000 in ints[1], name
        if "GROUP" in default_kw:  # the two-shot kernels that move items in groups
            assert (default_kw["GROUP"], tuned_kw["GROUP"]) == (1, 4), name  # a power of two
        if name == "two_shot":  # its last argument: items per program per round
            assert (default[-1], tuned[-1]) == (1, 5)
        if algorithm.kernel.lamport:  # the kernels that poll read the epilogue's operands first
            assert (default_kw["PRELOAD"], tuned_kw["PRELOAD"]) == (True, False), name
        # programmatic dependent launch as pdl_options says (stood in: these are CPU tensors)
        assert (default_kw.get("launch_pdl"), tuned_kw.get("launch_pdl")) == (True, None), name
        assert (default_kw.get("PDL"), tuned_kw.get("PDL")) == (True, None), name


def test_programmatic_dependent_launch_only_where_the_gpu_has_it(monkeypatch):
    # On for a CUDA tensor on sm_90 and later when the tuning asks for it; never on CPU ranks
    # (the interpreter has no griddepcontrol), on older GPUs, before CUDA 12.3, or with it off.
    from types import SimpleNamespace

    from infini_dist.kernels import symm_device
    from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning, pdl_options
    majors, cuda = {0: 9, 1: 8}, {"version": (12, 3)}
    monkeypatch.setattr(symm_device, "_major", lambda index: majors[index])
    monkeypatch.setattr(symm_device, "_cuda_version", lambda: cuda["version"])
    hopper, ampere = (SimpleNamespace(is_cuda=True, device=torch.device("cuda", i))
                      for i in (0, 1))
    assert pdl_options(DEFAULT_TUNING, hopper) == {"PDL": True, "launch_pdl": True}
    assert pdl_options(SymmTuning(pdl=False), hopper) == {}
    assert pdl_options(DEFAULT_TUNING, ampere) == {}
    assert pdl_options(DEFAULT_TUNING, torch.ones(2)) == {}
    cuda["version"] = (12, 2)  # graph capture of a programmatic launch needs 12.3
    assert pdl_options(DEFAULT_TUNING, hopper) == {}


# ---- every kernel through the registry, interpreted and on GPUs ----------------------------------

def test_every_kernel_interpreted_eight_ranks(monkeypatch):
    # Tensor parallelism usually runs at 8: every kernel at W = 8 (a bf16 and an fp32 buffer).
    # (Each kernel's own cases: tests/test_symm_<kernel>.py.)
    names = sorted(symm_algorithms())
    assert len(names) == 6, names
    cases = [(name, pattern, shape, dtype) for name in names
             for pattern, shape, dtype in (("add_rms_norm", (3, 40), torch.float32),
                                           ("relu_scale", (2, 24), torch.bfloat16))]
    run_interpreted(monkeypatch, 8, cases, data_bytes=1 << 16)


@pytest.mark.multigpu
def test_engine_picks_a_symm_kernel_on_gpus(tmp_path):
    # Each kernel on GPUs: tests/test_symm_<kernel>.py; here the engine end to end.
    run_gpu_worker(tmp_path, "--quick", "--only", "engine")
