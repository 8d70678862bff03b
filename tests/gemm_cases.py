"""Graphs, inputs and references for the GEMM + all-reduce tests (kernels/gemm_all_reduce.py,
scheduler/backends/symm_gemm.py): sites whose prologue starts with the matmul that makes the
all_reduce's input, as the compile pass builds them with config.matmul_prologue.

Each rank has its own x and its own weight shard (and bias), as in a row-parallel projection;
the epilogue's side tensors (residual, norm weight, up) are the same on every rank, so every rank
must get the same bits. The reference is symm_cases.reference: each rank's prologue through the
fp32 references (the matmul rounded once), the partial sums added in fp64 and rounded once.
"""

from __future__ import annotations

import torch

from infini_dist.scheduler.ir import OpNode, SubGraph
from symm_cases import RSTD, meta_from


def _linear(*inputs, transpose=True) -> OpNode:
    return OpNode("matmul", inputs, ("p",), {"transpose_weight": transpose})


_AR = OpNode("all_reduce", ("p",), ("y",))
_NORM = OpNode("add_rms_norm", ("y", "res", "w"), ("n", "r"), {"eps": 1e-5})

PATTERNS = {
    "linear": SubGraph((_linear("x", "wm"), _AR), ("x", "wm"), ("y",)),
    # the TP decoder's site: o_proj / down_proj, all_reduce, residual add + RMSNorm
    "linear_add_rms_norm": SubGraph((_linear("x", "wm"), _AR, _NORM), ("x", "wm", "res", "w"),
                                    ("n", "r")),
    "mm_bias_relu_scale": SubGraph(
        (_linear("x", "wm", "bias", transpose=False), _AR, OpNode("relu", ("y",), ("a",)),
         OpNode("scale", ("a",), ("b",), {"scale": 0.5})), ("x", "wm", "bias"), ("b",)),
    # an elementwise op between the matmul and the all_reduce, and a side after it
    "linear_silu_mul": SubGraph(
        (OpNode("matmul", ("x", "wm"), ("q",), {"transpose_weight": True}),
         OpNode("silu", ("q",), ("p",)), _AR, OpNode("mul", ("y", "up"), ("o",))),
        ("x", "wm", "up"), ("o",)),
    # a side after the all_reduce, nothing between it and the matmul
    "linear_mul": SubGraph((_linear("x", "wm"), _AR, OpNode("mul", ("y", "up"), ("o",))),
                           ("x", "wm", "up"), ("o",)),
    # a training forward's site: the rsqrt and the all_reduce's value kept too
    "linear_train": SubGraph((_linear("x", "wm"), _AR, _NORM,
                              OpNode(RSTD, ("r",), ("t",), {"eps": 1e-5})),
                             ("x", "wm", "res", "w"), ("y", "n", "r", "t")),
}


def weight_shape(graph: SubGraph, k: int, n: int) -> tuple:
    return (n, k) if graph.nodes[0].attr("transpose_weight") else (k, n)


def make_inputs(graph, x_shape, n, dtype, rank, call, device="cpu") -> dict:
    """x, the weight and the bias differ per rank and call; the epilogue's sides per call."""
    k = x_shape[-1]
    shapes = {"x": x_shape, "wm": weight_shape(graph, k, n), "bias": (n,), "w": (n,)}
    values = {}
    for name in graph.input_names:
        own = name in ("x", "wm", "bias")
        g = torch.Generator().manual_seed(1000 * call + (10 * rank if own else 500) + len(values))
        t = torch.randn(shapes.get(name, tuple(x_shape[:-1]) + (n,)), generator=g)
        if name == "wm":
            t = t / k ** 0.5  # unit-scale products
        if name == "w":
            t = 0.5 + t.abs()
        values[name] = t.to(dtype).to(device)
    return values


def meta_of(graph, x_shape, n, dtype, device_type="cuda") -> dict:
    """Every value's TensorMeta from one pass of the references on CPU, on `device_type`."""
    return meta_from(graph, make_inputs(graph, x_shape, n, dtype, 0, 0), device_type)


def widen_interpreted_bf16_dot() -> None:
    """Triton 3.9's interpreter multiplies bf16 tiles by their raw bits (it keeps bf16 as
    uint16 and hands those to np.matmul); widen them to fp32 first, which is what the GPU's
    dot computes with (exact products, fp32 sums). Only where the interpreter runs."""
    import triton.language as tl
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, *rest):
        wide = [self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t
                for t in (a, b)]
        return original(self, *wide, d, *rest)
    create_dot.widens_bf16 = True
    builder.create_dot = create_dot


def run_interpreted(monkeypatch, rank_fn, world_size: int, cases, data_bytes: int) -> None:
    """rank_fn(rank, world_size, storages, cases) on `world_size` ranks under Triton's
    interpreter, over shared CPU buffers of `data_bytes` standing in for symmetric memory, then
    `check_rank_results` of what each returned."""
    from infini_dist.kernels.symm_buffers import header_bytes
    from multirank import run_ranks
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # spawned ranks inherit it before importing triton
    storage = [torch.zeros(header_bytes(world_size) + data_bytes, dtype=torch.uint8)
               .share_memory_() for _ in range(world_size)]
    per_rank = run_ranks(rank_fn, world_size, storage, cases, timeout=300,
                         env={"TRITON_INTERPRET": "1"})
    check_rank_results(per_rank)


def check_rank_results(per_rank) -> None:
    """Per-rank lists of (case, error, digest), case[2] its dtype's name: every error within
    the tolerance (looser in bf16: the interpreter's rounding truncates), the same bits on
    every rank."""
    for results in zip(*per_rank):
        case, _, _ = results[0]
        tol = 1e-5 if case[2] == str(torch.float32) else 3e-2
        for rank, (_, error, _) in enumerate(results):
            assert error <= tol, f"{case} rank {rank}: error {error}"
        assert len({bits for _, _, bits in results}) == 1, f"{case}: ranks differ"
