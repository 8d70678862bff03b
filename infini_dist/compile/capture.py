"""What Inductor's CUDA-graph capture of a graph changes for the pass, read from this compile's
Inductor config (mode="reduce-overhead" turns `triton.cudagraphs` on)."""

from __future__ import annotations

import torch
import torch._inductor.config
import torch.fx as fx

from infini_dist.scheduler.settings import AUTO, Settings


def matmul_prologue(graph: fx.Graph, settings: Settings) -> bool:
    """config.matmul_prologue for this graph. "auto": where Inductor captures it in CUDA graphs
    (this compile's inductor config, which mode="reduce-overhead" sets) and its tensors are on
    CUDA, since replays hide the host time that a site with its GEMM adds (config.py)."""
    if settings.matmul_prologue != AUTO:
        return settings.matmul_prologue
    if not torch._inductor.config.triton.cudagraphs:
        return False
    found = devices(graph)
    # Inductor skips the capture of a graph that reads or makes CPU tensors, unless its graph
    # partition splits the CPU ops off (cudagraph_utils.check_multiple_devices_or_any_cpu_nodes).
    return "cuda" in found and ("cpu" not in found or bool(
        getattr(torch._inductor.config, "graph_partition", False)))


def scalars_reach_the_gpu() -> bool:
    """Whether Inductor moves the graph's CPU scalar inputs to the GPU, so that its CUDA graphs
    can capture what reads them (post_grad.move_constructors_to_gpu, under CUDA graphs with
    graph partitions). A site would then meet its run-time attributes on the GPU, and could not
    read them while a capture runs: the ops that read them stay Inductor's."""
    config = torch._inductor.config
    return bool(config.triton.cudagraphs and getattr(config, "graph_partition", False))


def devices(graph: fx.Graph) -> set[str]:
    """The device types of the tensors a graph reads (placeholders with readers) or makes
    (non-empty), as Inductor counts them for its CUDA-graph decision."""
    found = set()
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function") or not node.users:
            continue
        value = node.meta.get("val")
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if not isinstance(tensor, torch.Tensor):
                continue
            numel = tensor.numel()  # symbolic under dynamic shapes: asking would guard
            if node.op == "placeholder" or not (isinstance(numel, int) and numel == 0):
                found.add(tensor.device.type)
    return found - {"meta"}
