"""The engine's algorithms for sequence-parallel spans: `symm_scatter_gather`
(kernels/reduce_scatter_all_gather), a reduce_scatter, its epilogue on the shard and, where the
span ends in one, the all_gather of the epilogue's value, all in one launch; and
`one_shot_scatter_gather` (kernels/one_shot_scatter_gather), the same span where it gathers,
with one barrier instead of two: every rank reduces every row, so it moves W copies of the
whole input and is offered only as small as the one-shot all-reduce.

The epilogue is planned as the all-reduce kernels plan theirs (symm.plan_span), on a stand-in
span whose all_reduce has the shard's shape: the same chains, norms, rsqrt and quantizers, at
shard-local offsets. What the epilogue stores as `out` is the value gathered.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from infini_dist.kernels import one_shot_scatter_gather, reduce_scatter_all_gather
from infini_dist.kernels import symm_buffers
from infini_dist.kernels.nt_runtime import FastLaunch
from infini_dist.kernels.symm_chain import MAX_ROW
from infini_dist.kernels.symm_device import DEFAULT_TUNING
from infini_dist.scheduler.backends.symm import ONE_SHOT_MAX_BYTES, SpanPlan, plan_span
from infini_dist.scheduler.backends.symm_launch import PreparedAtFirstCall, warm_up
from infini_dist.scheduler.choices import Algorithm, FusedSpan, TensorMeta
from infini_dist.scheduler.ir import OpNode, SubGraph

MAX_BYTES = 256 << 20  # the input; its buffer holds two copies of it


@dataclasses.dataclass(frozen=True)
class ScatterPlan:
    epilogue: SpanPlan       # over the shard: `out` is the value gathered
    gathered: str | None     # the all_gather's output, if the span ends in one
    full_shape: tuple        # the reduce_scatter's input
    outputs: tuple           # the span's live outputs

    @property
    def rows(self) -> int:
        return math.prod(self.epilogue.shape[:-1])

    @property
    def shard_numel(self) -> int:
        return self.epilogue.numel


def plan_scatter(span, meta, ctx) -> ScatterPlan | None:
    """The launch plan for `span`, or None where the kernel cannot run it (pure, like every
    `supports`)."""
    graph = span.graph
    if span.prologue or len(span.anchors) != 1 or ctx.device.type != "cuda":
        return None
    anchor = graph.nodes[span.anchors[0]]
    if (anchor.op_type != "reduce_scatter" or anchor.attr("op", "sum") != "sum"
            or anchor.attr("group_size") != ctx.world_size):
        return None
    nodes = list(span.nodes(span.epilogue))
    gather = nodes.pop() if nodes and nodes[-1].op_type == "all_gather" else None
    if any(n.op_type in ("all_gather", "reduce_scatter", "all_reduce") for n in nodes):
        return None
    source, shard = anchor.inputs[0], anchor.outputs[0]
    full, part = meta.get(source), meta.get(shard)
    if full is None or part is None or len(part.shape) < 1 or not 0 < part.shape[-1] <= MAX_ROW:
        return None  # a program holds a whole row, norm or not
    # The stand-in: all_reduce(source) -> the epilogue, `source` with the shard's shape. Its
    # outputs: the span's, the gathered value in place of the gather's output.
    outputs = [n for n in span.outputs if gather is None or n != gather.outputs[0]]
    if gather is not None and gather.inputs[0] not in outputs:
        outputs.append(gather.inputs[0])
    stand_in = SubGraph((OpNode("all_reduce", (source,), (shard,)),) + tuple(nodes),
                        span.inputs, tuple(outputs))
    meta = dict(meta, **{source: TensorMeta(part.shape, full.dtype, full.device, True)})
    plan = plan_span(FusedSpan(stand_in, (), (0,), tuple(range(1, len(nodes) + 1))), meta,
                     dataclasses.replace(ctx, world_size=max(ctx.world_size, 2)))
    if plan is None or plan.prologue or plan.reduced is not None:
        return None  # a training graph's raw shard: the shard is never stored whole
    if gather is not None and (gather.inputs[0] != plan.out or gather.attr("group_name")
                               != anchor.attr("group_name")):
        return None
    return ScatterPlan(plan, gather.outputs[0] if gather is not None else None,
                       tuple(full.shape), tuple(span.outputs))


class SymmScatterGather(Algorithm):
    name = "symm_scatter_gather"
    module = reduce_scatter_all_gather  # the kernel file: its KIND, data_bytes, launch builder
    max_bytes = MAX_BYTES

    def plan(self, span, meta, ctx) -> ScatterPlan | None:
        """plan_scatter's plan where this algorithm runs it, else None."""
        plan = plan_scatter(span, meta, ctx)
        if (plan is None or ctx.world_size < 2 or not ctx.single_host
                or math.prod(plan.full_shape) * plan.epilogue.dtype.itemsize > self.max_bytes):
            return None
        return plan

    def supports(self, span, meta, ctx) -> bool:
        return self.plan(span, meta, ctx) is not None

    def data_bytes(self, plan: ScatterPlan, world_size: int) -> int:
        out = plan.epilogue.out_dtype or plan.epilogue.dtype
        size = max(plan.epilogue.dtype.itemsize, out.itemsize)
        return self.module.data_bytes(plan.shard_numel, size, world_size)

    def arguments(self, plan: ScatterPlan, tensors: dict, buffer, written: dict, gathered,
                  tuning=DEFAULT_TUNING):
        """(kernel, grid, args, kwargs) of one launch; `written` by SpanPlan.writes keyword,
        `out` among them only where the span gathers nothing."""
        outputs = dict(written)
        return self.module.reduce_scatter_all_gather_launch(
            tensors[plan.epilogue.source], buffer, outputs.pop("out", None), gathered,
            tuning=tuning, **plan.epilogue.launch_options(tensors), **outputs)

    @staticmethod
    def _outputs(plan: ScatterPlan, device) -> tuple[dict, torch.Tensor | None]:
        written = plan.epilogue.allocate(device)
        gathered = None
        if plan.gathered is not None:
            e = plan.epilogue
            gathered = torch.empty((plan.full_shape[0],) + tuple(e.shape[1:]),
                                   dtype=e.out_dtype or e.dtype, device=device)
            del written["out"]
        return written, gathered

    @staticmethod
    def _results(plan: ScatterPlan, written: dict, gathered, rank: int) -> dict:
        values = {}
        slot = {getattr(plan.epilogue, k): k for k in plan.epilogue.writes}
        for name in plan.outputs:
            if name == plan.gathered:
                values[name] = gathered
            elif slot.get(name) == "out" and gathered is not None:  # this rank's own rows
                rows = plan.epilogue.shape[0]
                values[name] = gathered[rank * rows:(rank + 1) * rows]
            else:
                values[name] = written[slot[name]]
        return values

    def launch(self, plan, env, buffer, tuning=DEFAULT_TUNING) -> dict:
        """One launch through Triton's normal path; inputs of any layout."""
        tensors = {n: env[n].contiguous() for n in plan.epilogue.tensor_inputs}
        device = tensors[plan.epilogue.source].device
        written, gathered = self._outputs(plan, device)
        kernel, grid, args, kwargs = self.arguments(plan, tensors, buffer, written, gathered,
                                                    tuning)
        kernel[grid](*args, **kwargs)
        return self._results(plan, written, gathered, buffer.rank)

    def compile(self, span, meta, ctx):
        plan = self.plan(span, meta, ctx)
        names = plan.epilogue.tensor_inputs if plan is not None else ()
        data_bytes, tuning, fast = warm_up(self, plan, names, meta, ctx)

        def prepare(env):  # collective: the buffer's allocation and rendezvous
            buffer = symm_buffers.get_buffer(ctx.group, ctx.device, self.module.KIND,
                                             data_bytes, 0)
            shapes = [env[n].shape for n in names]
            stand = {n: env[n].view(env[n].shape) for n in names}
            written = {k: object() for k in plan.epilogue.writes if k != "out"
                       or plan.gathered is None}
            gathered = object() if plan.gathered is not None else None
            kernel, grid, args, kwargs = self.arguments(plan, stand, buffer, written, gathered,
                                                        tuning)
            per_call = [stand[n] for n in names] + list(written.values()) + (
                [gathered] if gathered is not None else [])
            launch = FastLaunch(kernel, grid, args, kwargs, per_call, enabled=fast)

            def run(env):
                tensors = [env[n] for n in names]
                if any(t.shape != s or not t.is_contiguous() for t, s in zip(tensors, shapes)):
                    return self.launch(plan, env, buffer, tuning)
                written, gathered = self._outputs(plan, tensors[0].device)
                launch(*tensors, *written.values(),
                       *([gathered] if gathered is not None else []))
                return self._results(plan, written, gathered, buffer.rank)
            return run
        return PreparedAtFirstCall(prepare)


class OneShotScatterGather(SymmScatterGather):
    """Spans that gather, small enough that every rank moving all of x to every peer costs less
    than the scatter-gather's second barrier (kernels/one_shot_scatter_gather)."""
    name = "one_shot_scatter_gather"
    module = one_shot_scatter_gather
    max_bytes = ONE_SHOT_MAX_BYTES  # x's bytes, each rank pushing them to every rank

    def plan(self, span, meta, ctx) -> ScatterPlan | None:
        plan = super().plan(span, meta, ctx)
        if plan is None or plan.gathered is None or self.module.unsupported(
                plan.epilogue.epilogue, plan.epilogue.quant) is not None:
            return None
        return plan

    def arguments(self, plan: ScatterPlan, tensors: dict, buffer, written: dict, gathered,
                  tuning=DEFAULT_TUNING):
        """(kernel, grid, args, kwargs) of one launch; `written` by SpanPlan.writes keyword,
        `out` not among them (it is the gathered value)."""
        return self.module.one_shot_scatter_gather_launch(
            tensors[plan.epilogue.source], buffer, gathered, tuning=tuning,
            **plan.epilogue.launch_options(tensors), **written)
