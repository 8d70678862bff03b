"""The engine's algorithm over kernels/gemm_all_reduce: `gemm_one_shot`, a span whose prologue
starts with the matmul that makes the all_reduce's input (matmul -> [elementwise ops] ->
all_reduce -> epilogue), as a Triton GEMM pushing each finished tile to every rank, then the
one-shot reduction and the epilogue.

What follows the matmul is planned as the all-reduce kernels plan it (symm.plan_span), on the
same span without the matmul: its value is then the source of the chain, never stored whole.
The matmul run natively before any all-reduce choice (the prologue at depth 0) is the engine's
own recursive generation, so those choices need nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infini_dist.kernels import gemm_all_reduce as kernel_module
from infini_dist.kernels import symm_buffers
from infini_dist.kernels.nt_runtime import FastLaunch
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning
from infini_dist.scheduler.backends.symm import SpanPlan, plan_span
from infini_dist.scheduler.backends.symm_launch import PreparedAtFirstCall, warm_up
from infini_dist.scheduler.choices import Algorithm, FusedSpan

# The output; every rank holds W copies of it. At 2 ranks and 2048 x 4096 bf16 (a 2048-token
# prefill of a 4096-wide model) the buffer is 64 MiB. Above this, the matmul then the best
# all-reduce choice (p0) remains.
MAX_BYTES = 32 << 20


@dataclass(frozen=True)
class GemmPlan:
    x: str                  # the matmul's input, [..., K]
    w: str                  # its weight, [N, K] (transpose_weight) or [K, N]
    bias: str | None        # the matmul's
    transpose_weight: bool
    k: int
    tail: SpanPlan          # prologue after the matmul, all_reduce, epilogue; source: the matmul

    @property
    def tensor_inputs(self) -> tuple:
        """Every input the launches read, each once: x, w, bias, then the tail's but its
        source."""
        names = (self.x, self.w, self.bias) + self.tail.tensor_inputs[1:]
        return tuple(dict.fromkeys(n for n in names if n))


def plan_gemm(span, meta, ctx) -> GemmPlan | None:
    """The launch plan for `span`, or None where the kernels cannot run it (pure, like every
    `supports`)."""
    if not span.prologue:
        return None
    head = span.graph.nodes[span.prologue[0]]
    if head.op_type != "matmul" or len(head.inputs) not in (2, 3):
        return None
    tail = plan_span(FusedSpan(span.graph, span.prologue[1:], span.anchors, span.epilogue), meta,
                     ctx)
    if tail is None or tail.source != head.outputs[0]:
        return None
    x, w, bias = (tuple(head.inputs) + (None,))[:3]
    if {x, w} & set(tail.tensor_inputs):
        return None  # the GEMM reads x and w by their strides, the epilogue contiguous
    transpose = bool(head.attr("transpose_weight", False))
    mx, mw, mb = meta.get(x), meta.get(w), meta.get(bias) if bias else None
    if mx is None or mw is None or (bias and mb is None) or len(mw.shape) != 2 \
            or not mx.shape:
        return None
    k, n = (mw.shape[1], mw.shape[0]) if transpose else mw.shape
    if (k == 0 or mx.shape[-1] != k or tail.shape != tuple(mx.shape[:-1]) + (n,)
            or any(m.dtype != tail.dtype or m.device != mx.device
                   for m in (mx, mw) + ((mb,) if mb else ()))
            or (mb is not None and tuple(mb.shape) != (n,))):
        return None
    return GemmPlan(x, w, bias, transpose, k, tail)


class GemmOneShot(Algorithm):
    name = "gemm_one_shot"

    def supports(self, span, meta, ctx) -> bool:
        plan = plan_gemm(span, meta, ctx)
        return plan is not None and plan.tail.numel * plan.tail.dtype.itemsize <= MAX_BYTES

    def data_bytes(self, plan: GemmPlan, world_size: int) -> int:
        return kernel_module.gemm_bytes(plan.tail.numel, plan.tail.dtype.itemsize, world_size)

    def launch_arguments(self, plan: GemmPlan, tensors: dict, buffer, written: dict,
                         tuning: SymmTuning = DEFAULT_TUNING) -> tuple:
        """The two launches for `plan`, `tensors` by input name (x as its [rows, K] view),
        `written` the outputs by SpanPlan.writes keyword."""
        return kernel_module.gemm_all_reduce_launch(
            tensors[plan.x], tensors[plan.w], buffer, matmul_bias=tensors.get(plan.bias),
            transpose_weight=plan.transpose_weight, tuning=tuning,
            **plan.tail.launch_options(tensors), **written)

    def launch(self, plan: GemmPlan, env: dict, buffer, tuning: SymmTuning = DEFAULT_TUNING):
        """Both launches through Triton's normal path; inputs of any layout."""
        # the GEMM takes any strides; the epilogue's operands are read as contiguous
        tensors = {n: env[n].contiguous() for n in plan.tensor_inputs[2:]}
        tensors.update({plan.x: env[plan.x].reshape(-1, plan.k), plan.w: env[plan.w]})
        written = plan.tail.allocate(tensors[plan.x].device)
        for kernel, grid, args, kwargs in self.launch_arguments(plan, tensors, buffer, written,
                                                                tuning):
            kernel[grid](*args, **kwargs)
        return plan.tail.results(written)

    def compile(self, span, meta, ctx):
        plan = plan_gemm(span, meta, ctx)
        data_bytes, tuning, fast = warm_up(self, plan, plan and plan.tensor_inputs, meta, ctx)
        return PreparedAtFirstCall(lambda env: PreparedGemm(
            self, plan, symm_buffers.get_buffer(ctx.group, ctx.device, kernel_module.KIND,
                                                data_bytes), env, tuning, fast))


def view_rows(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """x [..., K] as a [rows, K] view, or None where its layout needs a copy for that."""
    try:
        return x.view(-1, k)
    except RuntimeError:
        return None


def layout_of(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.data_ptr() % 16 == 0


class PreparedGemm:
    """Both launches of one plan on one buffer, bound once (nt_runtime.FastLaunch, as
    symm_launch.PreparedLaunch binds one): a call checks its inputs' shapes and strides against the
    first call's, allocates the outputs and launches; other layouts take `algorithm.launch`."""

    def __init__(self, algorithm: GemmOneShot, plan: GemmPlan, buffer, env: dict,
                 tuning: SymmTuning, fast: bool):
        self.algorithm, self.plan, self.buffer, self.tuning = algorithm, plan, buffer, tuning
        self.names = plan.tensor_inputs
        self.layouts = tuple(layout_of(env[n]) for n in self.names)
        rows = view_rows(env[plan.x], plan.k)
        # else every call takes the normal path
        self.enabled = fast and rows is not None and self.usable([env[n] for n in self.names])
        self.launches = []
        if not self.enabled:
            return
        # Stand-ins, each its own object, so FastLaunch can tell the per-call tensors apart.
        inputs = {n: env[n].view(env[n].shape) for n in self.names}
        inputs[plan.x] = rows
        written = {key: object() for key in plan.tail.writes}
        per_call = [inputs[n] for n in self.names] + list(written.values())
        self.launches = [FastLaunch(kernel, grid, args, kwargs, per_call)
                         for kernel, grid, args, kwargs in algorithm.launch_arguments(
                             plan, inputs, buffer, written, tuning)]

    def usable(self, tensors) -> bool:
        """Whether `tensors` (by self.names) have the bound call's layouts: the first call's
        shapes, strides and 16-byte alignments (the GEMM's tensor descriptors are bound by
        them), all but x and w (the GEMM takes any strides) contiguous."""
        return all(layout_of(t) == layout and (i < 2 or t.is_contiguous())
                   for i, (t, layout) in enumerate(zip(tensors, self.layouts)))

    def __call__(self, env: dict) -> dict:
        tensors = [env[n] for n in self.names]
        if not self.enabled or not self.usable(tensors):
            return self.algorithm.launch(self.plan, env, self.buffer, self.tuning)
        tensors[0] = tensors[0].view(-1, self.plan.k)  # x first (tensor_inputs), as [rows, K]
        if tensors[0].is_cuda:  # this thread may never have bound a launch
            kernel_module.scratch_allocator()
        written = self.plan.tail.allocate(tensors[0].device)
        for launch in self.launches:
            launch(*tensors, *written.values())
        return self.plan.tail.results(written)
