"""Keeping torch's CUDA-graph trees usable when our op raises during a tree's warm-up.

A tree (mode="reduce-overhead" / "max-autotune") runs a new graph's first call as a warm-up node
that it makes current *before* running the graph, and fills in the node's output records only
when the graph returns. If the graph raises (a site's tuning failed: a rank timed out, inputs
differ across ranks), the node stays current with no output records while it has one stack trace
per output, and torch 2.11's next step over the path asserts `len(node.tensor_weakrefs) ==
len(node.stack_traces)`: every compiled model in the process then fails, not only ours.

`settle_failed_warmup` gives such a node one empty (dead) record per output, the state of a
warm-up whose outputs were all freed, so the tree moves on at the next call. It reads torch
internals (torch._inductor.cudagraph_trees) and does nothing where they differ.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("infini_dist")


def settle_failed_warmup(tensors) -> None:
    """Call while an exception from our op propagates; `tensors` are the op's inputs."""
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return
    try:
        from torch._inductor import cudagraph_trees as trees
        manager = trees.get_manager(device.index, create_if_none_exists=False)
        if manager is None or not manager.in_warmup:
            return
        node = manager.current_node
        traces = getattr(node, "stack_traces", None)
        if (not isinstance(node, trees.CUDAWarmupNode) or traces is None
                or node.outputs_weakrefs or node.tensor_weakrefs):
            return  # not a warm-up cut short, or one that recorded its outputs
        node.outputs_weakrefs.extend([None] * len(traces))
        node.tensor_weakrefs.extend([None] * len(traces))
        log.info("infini_dist: an error in a CUDA-graph tree warm-up; its node settled as dead")
    except Exception as error:  # noqa: BLE001 - never mask the error being raised
        log.debug("infini_dist: could not settle the CUDA-graph tree (%s)", error)
