"""Engine algorithms over our symmetric-memory all-reduce kernels: `one_shot` and `two_shot`
(block barriers), `one_shot_lamport`, `two_shot_lamport` (the data is the signal) and
`two_shot_polled_gather` (a barrier after the reduce-scatter, a polled all-gather) and
`one_shot_lamport_streamed` (pushes and reductions interleaved, for large tensors at few ranks).

A span is supported when it is one sum all_reduce of a CUDA float tensor with
  - a prologue: a chain (up to 3) of elementwise ops on the all_reduce input;
  - an epilogue: a chain (up to 3) of elementwise ops, optionally ended by a norm over the last
    dimension (any op whose spec has a `symm_norm`, kernels/epilogue), itself optionally
    followed by the rms_rstd of the value it normalises (an RMSNorm's rsqrt, which a training
    forward saves for backward), then optionally by an output quantization (a `symm_quant`:
    FP8 static after either, per-token after a norm);
and nothing else of the span is read outside it except the final value (the quantizer's
outputs, where one ends it), the value the norm normalises (the new residual), that rsqrt and
the all_reduce's own value (a training graph may keep it too). Every depth, 0 included (a plain
symmetric-memory all-reduce).

Rendezvous is collective, so it happens lazily in a runner's first call, never in `compile`: the
engine compiles choices in a thread pool (no order across ranks), but runs each choice's first
call in lockstep on every rank and eagerly, before any CUDA-graph capture. `compile` does the
local work: it builds the launch and runs it once on private scratch memory whose barriers are
pre-satisfied, which compiles the Triton kernel with no cross-rank traffic.

A runner launches through `PreparedLaunch` (symm_launch.py): everything but the tensors is bound once per
(plan, buffer), and after its first call the compiled kernel is launched directly
(`nt_runtime.FastLaunch`), which cuts most of the Python from each eager call
(docs/notes_symm.md, "Host launch overhead", has the figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.lamport_one_shot import lamport_one_shot_all_reduce
from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from infini_dist.kernels.lamport_two_shot import lamport_two_shot_all_reduce
from infini_dist.kernels.one_shot_all_reduce import one_shot_all_reduce
from infini_dist.kernels.rows import FLOAT_DTYPES
from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.epilogue.rms_rstd import SPEC as RSTD_SPEC
from infini_dist.kernels.symm_chain import (MAX_CHAIN, MAX_ROW, NO_NORM, NORM_CODES, QUANT_CODES,
                                            RSTD_NORMS, encode_node)
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning
from infini_dist.kernels.two_shot_all_reduce import two_shot_all_reduce
from infini_dist.kernels.two_shot_polled_gather import two_shot_polled_gather_all_reduce
from infini_dist.scheduler import op_registry
from infini_dist.scheduler.backends.symm_launch import (PreparedAtFirstCall, PreparedLaunch,
                                                         warm_up)
from infini_dist.scheduler.choices import Algorithm

ONE_SHOT_MAX_BYTES = 8 << 20   # past this every rank moving the whole tensor W times loses
TWO_SHOT_MAX_BYTES = 1 << 30
# A Lamport two-shot buffer holds four copies of the tensor (two halves of staging + gathered),
# and polling plus emptying cost more than two barriers once the tensor is large (measured on
# 4 H200s with 4096-wide bf16 rows: Lamport wins at small token counts, loses at large ones).
LAMPORT_TWO_SHOT_MAX_BYTES = 8 << 20
# Its buffer holds 4 copies of the tensor; beyond this the barrier two-shot's one copy wins.
POLLED_GATHER_MAX_BYTES = 64 << 20
# The streamed one-shot's buffer holds 2 W copies, and it sends (W - 1) copies a rank: capped by
# its buffer, it covers 64 MiB at 2 ranks, 16 MiB at 8 (where two-shots move a quarter of that).
STREAMED_MAX_BUFFER_BYTES = 256 << 20


@dataclass(frozen=True)
class SpanPlan:
    """What one fused span asks of a kernel launch, by value name."""
    source: str                   # the input the prologue starts from
    prologue: tuple               # ChainOps
    epilogue: tuple
    norm: int
    weight: str | None
    bias: str | None
    residual: str | None
    eps: float
    out: str                      # the value the kernel's `out` holds
    pre: str | None               # the value its `pre` holds (the norm's input), if live
    rstd: str | None              # the value its `rstd` holds (rms_rstd of `pre`), if live
    reduced: str | None           # the all_reduce's value, if live and no other output holds it
    outputs: tuple                # the span's live outputs, each one of the above
    shape: tuple
    dtype: torch.dtype
    row_len: int | None
    quant: int = 0                # quant code (symm_chain.QUANT_CODES), 0: none
    quant_scale: float = 0.0
    out_dtype: torch.dtype | None = None  # `out`'s dtype where quantized
    scales: str | None = None     # the value a per-row quantizer's scales hold, if live
    quant_scale_input: str | None = None  # the one-element scale tensor a quantizer reads

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sides(self) -> tuple:
        return tuple(op.side for op in self.prologue + self.epilogue if op.side is not None)

    @property
    def tensor_inputs(self) -> tuple:
        """Every input the kernel reads, each once: the source, then sides, weight, bias,
        residual, the quantizer's scale tensor."""
        names = (self.source,) + self.sides + (self.weight, self.bias, self.residual,
                                               self.quant_scale_input)
        return tuple(dict.fromkeys(n for n in names if n))

    @property
    def writes(self) -> tuple:
        """The kernel's outputs this plan has it write, by their fused_arguments keywords."""
        return ("out",) + tuple(k for k in ("pre", "rstd", "reduced", "scales")
                                if getattr(self, k))

    def allocate(self, device, like: torch.Tensor | None = None) -> dict:
        """Fresh tensors for `writes`: `out` in the quantizer's dtype where quantized, the others
        in the plan's; rstd and a per-row quantizer's scales fp32, one per row. `like`: a
        contiguous tensor of the plan's shape on `device`, allocated after (empty_like takes
        half the host time of torch.empty(shape, dtype=, device=))."""
        def empty(key):
            if key in ("rstd", "scales"):
                return torch.empty(self.shape[:-1] + (1,), dtype=torch.float32, device=device)
            dtype = (self.out_dtype or self.dtype) if key == "out" else self.dtype
            if like is not None:
                return torch.empty_like(like, dtype=dtype)
            return torch.empty(self.shape, dtype=dtype, device=device)
        return {k: empty(k) for k in self.writes}

    def launch_options(self, tensors: dict) -> dict:
        """The launch builders' options but outputs (symm_chain.fused_arguments)."""
        operands = {k: tensors[getattr(self, k)] if getattr(self, k) else None
                    for k in ("weight", "bias", "residual")}
        scale = (tensors[self.quant_scale_input] if self.quant_scale_input
                 else self.quant_scale)  # a tensor is read at run time, a number baked in
        return dict(prologue=self.prologue, epilogue=self.epilogue, sides=tensors, norm=self.norm,
                    eps=self.eps, row_len=self.row_len, quant=self.quant, quant_scale=scale,
                    **operands)

    def results(self, written: dict) -> dict:
        slot = {getattr(self, k): k for k in self.writes}
        return {name: written[slot[name]] for name in self.outputs}


def _same(meta, name, like) -> bool:
    m = meta.get(name)
    return m is not None and m.shape == like.shape and m.dtype == like.dtype


def plan_span(span, meta, ctx) -> SpanPlan | None:
    """The launch plan for `span`, or None where our kernels cannot run it. Pure: every rank
    answers the same for the same span."""
    graph = span.graph
    if (len(span.anchors) != 1 or ctx.device.type != "cuda" or ctx.world_size < 2
            or not ctx.single_host):  # peer memory needs every pair of ranks on one host
        return None
    anchor = graph.nodes[span.anchors[0]]
    if anchor.op_type != "all_reduce" or anchor.attr("op", "sum") != "sum" \
            or len(anchor.inputs) != 1:
        return None
    external = set(span.inputs)

    prologue_nodes = span.nodes(span.prologue)
    current = prologue_nodes[0].inputs[0] if prologue_nodes else anchor.inputs[0]
    source = current
    x = meta.get(source)
    if x is None or x.dtype not in FLOAT_DTYPES or x.device.type != "cuda" or not x.shape \
            or 0 in x.shape:
        return None

    def side_kind(name):
        m = meta.get(name)
        if name not in external or m is None or m.dtype != x.dtype:
            return None
        return "row" if m.shape == x.shape else "vector" if m.shape == x.shape[-1:] else None

    def chain(nodes, current):
        ops = []
        for node in nodes:
            op = (encode_node(node, current, side_kind, x.shape[-1]) if len(node.outputs) == 1
                  else None)
            if op is None:
                return None, current
            ops.append(op)
            current = node.outputs[0]
        return tuple(ops), current

    if len(prologue_nodes) > MAX_CHAIN:
        return None
    prologue, current = chain(prologue_nodes, current)
    if prologue is None or current != anchor.inputs[0] or not _same(meta, current, x):
        return None

    epilogue_nodes = list(span.nodes(span.epilogue))
    quant_node = None  # the chain ends: [ops..] [norm [rms_rstd]] [quantizer]
    if epilogue_nodes and epilogue_nodes[-1].op_type in QUANT_CODES:
        quant_node = epilogue_nodes.pop()
    rstd_node = None
    if epilogue_nodes and epilogue_nodes[-1].op_type == RSTD_SPEC.name:
        rstd_node = epilogue_nodes.pop()
    norm_node = None
    if epilogue_nodes and op_registry.get_op(epilogue_nodes[-1].op_type).kind == "rowwise":
        norm_node = epilogue_nodes[-1]
        epilogue_nodes = epilogue_nodes[:-1]
    if len(epilogue_nodes) > MAX_CHAIN:
        return None
    epilogue, current = chain(epilogue_nodes, anchor.outputs[0])
    if epilogue is None or not _same(meta, current, x):
        return None

    norm, eps, pre, out, operands = NO_NORM.value, 0.0, None, current, {}
    if norm_node is not None:
        found = _norm_operands(norm_node, current, x, meta, external)
        if found is None:
            return None
        norm, operands = NORM_CODES[norm_node.op_type], found
        out = norm_node.outputs[0]
        # add_rms_norm's second output is the sum it normalises
        pre = norm_node.outputs[1] if len(norm_node.outputs) > 1 else current
        eps = norm_node.attr("eps", dict(SPECS[norm_node.op_type].attrs)["eps"])
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            return None
    rstd = None
    if rstd_node is not None:
        if not _rstd_of(rstd_node, norm, pre, eps):
            return None
        rstd = rstd_node.outputs[0]
    quant = {}
    if quant_node is not None:
        quant = _quant(quant_node, out, norm, x, meta, external)
        if quant is None:
            return None
        out = quant_node.outputs[0]
    scales = quant.get("scales")
    outputs = tuple(span.outputs)
    reduced = anchor.outputs[0] if anchor.outputs[0] not in (out, pre) else None
    if not set(outputs) <= {out, pre, rstd, reduced, scales} - {None}:
        return None  # an intermediate value is read elsewhere; we do not write it
    return SpanPlan(source, prologue, epilogue, norm, operands.get("weight"),
                    operands.get("bias"), operands.get("residual"), float(eps), out,
                    *(name if name in outputs else None for name in (pre, rstd, reduced)),
                    outputs, tuple(x.shape), x.dtype,
                    x.shape[-1] if norm != NO_NORM.value else None,
                    quant.get("quant", 0), quant.get("quant_scale", 0.0),
                    quant.get("out_dtype"), scales if scales in outputs else None,
                    quant.get("quant_scale_input"))


def _quant(node, current, norm, x, meta, external) -> dict | None:
    """The quantizer node's plan fields, or None where the kernels cannot run it: it reads the
    final value; a per-row one needs the norm's layout (a whole row per item); a scale tensor
    is one float element on x's device, from outside the span."""
    spec = SPECS[node.op_type]
    scale_input = node.inputs[1] if spec.symm_quant.scale_operand else None
    if tuple(node.inputs) != (current,) + ((scale_input,) if scale_input else ()) \
            or len(node.outputs) != spec.num_outputs:
        return None
    if spec.symm_quant.row_scale and norm == NO_NORM.value:
        return None
    if scale_input is not None:
        m = meta.get(scale_input)
        if (scale_input not in external or m is None or math.prod(m.shape) != 1
                or not m.dtype.is_floating_point or m.device != x.device):
            return None
        return {"quant": QUANT_CODES[node.op_type], "out_dtype": spec.out_dtype,
                "quant_scale_input": scale_input}
    scale = 0.0
    if spec.symm_quant.scalar is not None:
        scale = node.attr(spec.symm_quant.scalar, dict(spec.attrs)[spec.symm_quant.scalar])
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            return None
    return {"quant": QUANT_CODES[node.op_type], "quant_scale": float(scale),
            "out_dtype": spec.out_dtype,
            "scales": node.outputs[1] if spec.symm_quant.row_scale else None}


def _rstd_of(node, norm: int, pre, eps) -> bool:
    """Whether rms_rstd `node` is the rsqrt the norm multiplies by: a norm that has one, of the
    value it normalises, with its eps (so the kernel's value is the one rms_rstd means)."""
    rstd_eps = node.attr("eps", dict(RSTD_SPEC.attrs)["eps"])
    return norm in RSTD_NORMS and tuple(node.inputs) == (pre,) and rstd_eps == eps


def _norm_operands(node, current, x, meta, external) -> dict | None:
    """The norm node's operands by role (its spec's symm_norm), or None where the kernels cannot
    run it: the chain value and a residual (they commute) of x's shape, weight and bias rows."""
    spec = SPECS.get(node.op_type)
    if spec is None or spec.symm_norm is None or x.shape[-1] > MAX_ROW:
        return None
    roles = dict(zip(spec.symm_norm.roles, node.inputs))
    if "residual" in roles and roles["residual"] == current:
        roles["value"], roles["residual"] = roles["residual"], roles["value"]
    if roles.pop("value") != current or current in roles.values():
        return None
    for role, name in roles.items():
        m = meta.get(name)
        shape = x.shape if role == "residual" else x.shape[-1:]
        if name not in external or m is None or m.shape != shape or (
                m.dtype != x.dtype if role == "residual" else not m.dtype.is_floating_point):
            return None
    return roles


class SymmAllReduce(Algorithm):
    """The engine's choice `name`: one symm_call.SymmKernel (`kernel`) for spans of at most
    `max_bytes` whose buffer needs at most `max_buffer_bytes` (None: no limit)."""

    def __init__(self, name: str, kernel, max_bytes: int, max_buffer_bytes: int | None = None):
        self.name, self.kernel, self.max_bytes = name, kernel, max_bytes
        self.max_buffer_bytes = max_buffer_bytes

    @property
    def kind(self) -> str:
        return self.kernel.kind

    def data_bytes(self, plan: SpanPlan, world_size: int) -> int:
        return self.kernel.data_bytes(plan.numel, plan.dtype.itemsize, world_size, plan.row_len,
                                      plan.norm)

    def supports(self, span, meta, ctx) -> bool:
        plan = plan_span(span, meta, ctx)
        return plan is not None and plan.numel * plan.dtype.itemsize <= self.max_bytes and (
            self.max_buffer_bytes is None
            or self.data_bytes(plan, ctx.world_size) <= self.max_buffer_bytes)

    def launch_arguments(self, plan: SpanPlan, x, tensors: dict, buffer, written: dict,
                         tuning: SymmTuning = DEFAULT_TUNING):
        """(kernel, grid, args, kwargs) of the launch for `plan`, `tensors` by input name,
        `written` the outputs by plan.writes keyword."""
        return self.kernel.launch(x, buffer, tuning=tuning, **plan.launch_options(tensors),
                                  **written)

    def launch(self, plan: SpanPlan, env: dict, buffer,
               tuning: SymmTuning = DEFAULT_TUNING) -> dict:
        """One launch through Triton's normal path; inputs of any layout."""
        tensors = {name: env[name].contiguous() for name in plan.tensor_inputs}
        x = tensors[plan.source]
        written = plan.allocate(x.device, x)
        kernel, grid, args, kwargs = self.launch_arguments(plan, x, tensors, buffer, written,
                                                           tuning)
        kernel[grid](*args, **kwargs)
        return plan.results(written)

    def compile(self, span, meta, ctx):
        plan = plan_span(span, meta, ctx)
        data_bytes, tuning, fast = warm_up(self, plan, plan and plan.tensor_inputs, meta, ctx)
        return PreparedAtFirstCall(lambda env: PreparedLaunch(
            self, plan, symm_buffers.get_buffer(ctx.group, ctx.device, self.kind, data_bytes,
                                                self.kernel.lamport_width(plan.dtype)),
            env, tuning, fast))


def algorithms() -> list[SymmAllReduce]:
    """One algorithm per kernel, under the names the engine's decisions are cached by."""
    return [SymmAllReduce("one_shot", one_shot_all_reduce, ONE_SHOT_MAX_BYTES),
            SymmAllReduce("two_shot", two_shot_all_reduce, TWO_SHOT_MAX_BYTES),
            SymmAllReduce("one_shot_lamport", lamport_one_shot_all_reduce, ONE_SHOT_MAX_BYTES),
            SymmAllReduce("two_shot_lamport", lamport_two_shot_all_reduce,
                          LAMPORT_TWO_SHOT_MAX_BYTES),
            SymmAllReduce("two_shot_polled_gather", two_shot_polled_gather_all_reduce,
                          POLLED_GATHER_MAX_BYTES),
            SymmAllReduce("one_shot_lamport_streamed", lamport_one_shot_streamed_all_reduce,
                          TWO_SHOT_MAX_BYTES, STREAMED_MAX_BUFFER_BYTES)]
