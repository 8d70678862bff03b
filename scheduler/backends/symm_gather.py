"""The engine's algorithm for an all_gather site: `lamport_all_gather`
(kernels/lamport_all_gather.py), the gather alone in one launch, Lamport-signalled.

It takes the all_gather with nothing fused: a norm before a gather stays in Inductor's kernel
(compile/scatter_gather_match.py), and the span reduce_scatter -> norm -> all_gather is
symm_scatter's. What it is for is the small gather of a TP model's step, e.g. the lm_head's
logits gathered over the vocabulary in every decode step, where NCCL's call is mostly latency.
"""

from __future__ import annotations

import dataclasses

import torch

from infini_dist.kernels import lamport_all_gather, symm_buffers
from infini_dist.kernels.nt_runtime import FastLaunch
from infini_dist.kernels.rows import FLOAT_DTYPES
from infini_dist.kernels.symm_device import DEFAULT_TUNING
from infini_dist.scheduler.backends.symm_launch import PreparedAtFirstCall, warm_up
from infini_dist.scheduler.choices import Algorithm

# The input's bytes. The buffer holds two halves of W copies of it; the transfer is NCCL's
# (every rank receives W - 1 copies), so the cap bounds the buffer, not the traffic.
MAX_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    source: str
    gathered: str
    shape: tuple  # the input's
    dtype: torch.dtype
    world_size: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def tensor_inputs(self) -> tuple:
        return (self.source,)

    def output_shape(self) -> tuple:
        return (self.world_size * self.shape[0],) + tuple(self.shape[1:])


def plan_gather(span, meta, ctx) -> GatherPlan | None:
    """The plan for `span` (a lone all_gather over the whole group), or None (pure)."""
    if span.prologue or span.epilogue or len(span.anchors) != 1 or ctx.device.type != "cuda":
        return None
    anchor = span.graph.nodes[span.anchors[0]]
    x = meta.get(anchor.inputs[0])
    if (anchor.op_type != "all_gather" or anchor.attr("group_size") != ctx.world_size
            or ctx.world_size < 2 or not ctx.single_host or x is None
            or x.dtype not in FLOAT_DTYPES or len(x.shape) == 0
            or not 0 < int(torch.Size(x.shape).numel()) * x.dtype.itemsize <= MAX_BYTES):
        return None
    return GatherPlan(anchor.inputs[0], anchor.outputs[0], tuple(x.shape), x.dtype,
                      ctx.world_size)


class LamportAllGather(Algorithm):
    name = "lamport_all_gather"
    module = lamport_all_gather  # the kernel file: its KIND, data_bytes, launch builder

    def plan(self, span, meta, ctx) -> GatherPlan | None:
        return plan_gather(span, meta, ctx)

    def supports(self, span, meta, ctx) -> bool:
        return self.plan(span, meta, ctx) is not None

    def data_bytes(self, plan: GatherPlan, world_size: int) -> int:
        return self.module.data_bytes(plan.numel, plan.dtype.itemsize, world_size)

    def launch(self, plan: GatherPlan, env, buffer, tuning=DEFAULT_TUNING) -> dict:
        """One launch through Triton's normal path; an input of any layout."""
        x = env[plan.source].contiguous()
        out = torch.empty(plan.output_shape(), dtype=plan.dtype, device=x.device)
        kernel, grid, args, kwargs = self.module.lamport_all_gather_launch(x, buffer, out,
                                                                          tuning=tuning)
        kernel[grid](*args, **kwargs)
        return {plan.gathered: out}

    def compile(self, span, meta, ctx):
        plan = self.plan(span, meta, ctx)
        data_bytes, tuning, fast = warm_up(self, plan, plan and plan.tensor_inputs, meta, ctx)

        def prepare(env):  # collective: the buffer's allocation and rendezvous
            buffer = symm_buffers.get_buffer(ctx.group, ctx.device, self.module.KIND,
                                             data_bytes, plan.dtype.itemsize * 8)
            stand, gathered = env[plan.source].view(plan.shape), object()
            kernel, grid, args, kwargs = self.module.lamport_all_gather_launch(
                stand, buffer, gathered, tuning=tuning)
            launch = FastLaunch(kernel, grid, args, kwargs, [stand, gathered], enabled=fast)

            def run(env):
                x = env[plan.source]
                if x.shape != plan.shape or not x.is_contiguous():
                    return self.launch(plan, env, buffer, tuning)
                out = torch.empty(plan.output_shape(), dtype=plan.dtype, device=x.device)
                launch(x, out)
                return {plan.gathered: out}
            return run
        return PreparedAtFirstCall(prepare)
