"""`torch_mm_reduce_scatter`: torch's own overlapped GEMM + reduce-scatter
(`torch.ops.symm_mem.fused_matmul_reduce_scatter`, what torch.compile's async tensor parallelism
emits), then an all_gather: the matmul and its all_reduce, the GEMM computed chunk by chunk while
finished chunks travel to the ranks that reduce them.

Unfused torch equivalent (w [N, K] with transpose_weight, else [K, N]):
    y = x @ w.T;  dist.all_reduce(y)
as run here:
    shard = fused_matmul_reduce_scatter(x.view(rows, K), w.T, "sum", 0, group)  # rows / W each
    dist.all_gather_into_tensor(y, shard)

Each rank reduces its own rows and every rank gathers the same shards, so all ranks get the same
bits. Where it applies (the span: the matmul feeding the all_reduce, nothing between, nothing
after; the epilogue runs after it as torch runs it): CUDA, two or more ranks on one host, no
bias (torch's op has none), token rows divisible by W (it scatters them), a torch that has the
op. Its symmetric workspace is allocated and rendezvoused at its first run, which the engine
makes eagerly and in lockstep on every rank (the trial run), never under CUDA-graph capture.
"""

from __future__ import annotations

import math

import torch

from infini_dist.kernels.rows import FLOAT_DTYPES
from infini_dist.scheduler import data_plane
from infini_dist.scheduler.choices import Algorithm


def _op():
    """torch's op, or None where this torch has none (it registers on importing the module)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return None
    return getattr(getattr(torch.ops, "symm_mem", None), "fused_matmul_reduce_scatter", None)


class TorchMatmulReduceScatter(Algorithm):
    name = "torch_mm_reduce_scatter"

    def supports(self, span, meta, ctx) -> bool:
        graph = span.graph
        if (ctx.device.type != "cuda" or ctx.world_size < 2 or not ctx.single_host
                or len(span.anchors) != 1 or len(span.prologue) != 1 or span.epilogue):
            return False
        head, anchor = graph.nodes[span.prologue[0]], graph.nodes[span.anchors[0]]
        if (head.op_type != "matmul" or len(head.inputs) != 2 or anchor.op_type != "all_reduce"
                or tuple(anchor.inputs) != tuple(head.outputs)
                or anchor.attr("op", "sum") != "sum"):
            return False
        x, w = (meta.get(n) for n in head.inputs)
        if x is None or w is None or x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
            return False
        rows = math.prod(x.shape[:-1])
        return rows > 0 and rows % ctx.world_size == 0 and _op() is not None

    def compile(self, span, meta, ctx):
        op = _op()
        if op is None:
            raise RuntimeError("this torch has no symm_mem.fused_matmul_reduce_scatter")
        import torch.distributed as dist
        graph = span.graph
        head, anchor = graph.nodes[span.prologue[0]], graph.nodes[span.anchors[0]]
        x_name, w_name = head.inputs
        transpose = bool(head.attr("transpose_weight", False))
        reduced = anchor.outputs[0]
        shape = meta[reduced].shape
        group = ctx.group or dist.group.WORLD
        name = group.group_name  # (torch >= 2.11 needs no enable_symm_mem_for_group first)

        def run(env):
            x, w = env[x_name], env[w_name]
            shard = op(x.reshape(-1, x.shape[-1]), w.t() if transpose else w, "sum", 0, name)
            out = torch.empty((shard.shape[0] * ctx.world_size, shard.shape[1]),
                              dtype=shard.dtype, device=shard.device)
            data_plane.all_gather(out, shard, ctx.group)
            return {reduced: out.view(shape)}
        return run
