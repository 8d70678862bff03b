"""The CPU (and device-agnostic) fused path: one function doing prologue, reduce and epilogue.

Several coalesced all_reduces of one dtype are packed into a single buffer and reduced with one
collective call. The reduction itself goes through torch.distributed, so this serves any backend;
it is registered for CPU tensors, where gloo is the collective.
"""

from __future__ import annotations

import torch
from infini_dist.scheduler import data_plane
from infini_dist.scheduler.choices import Algorithm, register_algorithm, run_nodes


class TorchFusedAllReduce(Algorithm):
    name = "torch_fused"

    def supports(self, span, meta, ctx):
        anchor_inputs = [n for a in span.anchors for n in span.graph.nodes[a].inputs]
        dtypes = {meta[n].dtype for n in anchor_inputs if n in meta}
        # At depth zero with one anchor this is native again: not a separate choice.
        return span.fuses_anything and len(dtypes) == 1

    def compile(self, span, meta, ctx):
        graph = span.graph
        anchors = [graph.nodes[a] for a in span.anchors]
        outputs = span.outputs

        def run(env):
            local = dict(env)
            run_nodes(graph, span.prologue, local, ctx)
            sources = [local[n] for node in anchors for n in node.inputs]
            packed = torch.cat([s.reshape(-1) for s in sources])  # a fresh, contiguous buffer
            data_plane.all_reduce(packed, ctx.group)
            offset = 0
            for node in anchors:
                for name_in, name_out in zip(node.inputs, node.outputs):
                    source = local[name_in]
                    local[name_out] = packed[offset:offset + source.numel()].view(source.shape)
                    offset += source.numel()
            run_nodes(graph, span.epilogue, local, ctx)
            return {n: local[n] for n in outputs}
        return run


register_algorithm("all_reduce", "cpu", TorchFusedAllReduce())
