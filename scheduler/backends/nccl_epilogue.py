"""`nccl+nt_epilogue`: one NCCL all_reduce, then its whole epilogue as ONE ninetoothed kernel.

Unfused torch (the epilogue here: add -> rms_norm):
    y = x.clone(); dist.all_reduce(y, group=group)
    h = y + residual; out = rms_norm(h, weight, eps)        # one kernel launch per op

The epilogue nodes become a chain (`infini_dist.kernels.chain`): any run of elementwise ops, with
rms_norm / add_rms_norm anywhere in it, reading the reduced value and side tensors; a norm's
output may be quantized to FP8, statically or per token (the scales: a per-row output, rows x 1,
fp32). The kernel writes only the span's live outputs; when the reduced value itself is not one
of them, its buffer takes one of the outputs of its shape and dtype in place (no extra
allocation). Tile shapes depend on shapes alone, so every rank runs the same kernel and gets
bitwise the same result from the same reduced input.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from infini_dist.kernels.chain import Chain, UnsupportedChain, chain_from_nodes
from infini_dist.kernels.rows import (FLOAT_DTYPES, INT32_LIMIT, MAX_ROW_BLOCK, broadcast_shape,
                                      next_power_of_2)
from infini_dist.scheduler.choices import Algorithm
from infini_dist.scheduler.boundary import external_inputs


class _Plan(NamedTuple):
    source: str  # the all_reduce input
    reduced: str  # the all_reduce output
    chain: Chain
    chain_inputs: tuple[str, ...]  # the reduced value first
    chain_outputs: tuple[str, ...]
    returns_reduced: bool  # the reduced value is itself a span output
    in_place: int | None  # which chain output may be written into the reduced buffer


def _meta(meta, name):
    if name not in meta:
        raise UnsupportedChain(f"no tensor metadata for {name!r}")
    return meta[name]


def plan(span, meta) -> _Plan:
    """How to run `span`; raises UnsupportedChain when this algorithm cannot."""
    graph = span.graph
    if span.prologue or len(span.anchors) != 1 or not span.epilogue:
        raise UnsupportedChain("needs one all_reduce, no prologue and at least one epilogue node")
    anchor = graph.nodes[span.anchors[0]]
    if anchor.op_type != "all_reduce" or len(anchor.inputs) != 1:
        raise UnsupportedChain("the anchor must be a single (not coalesced) all_reduce")
    if anchor.attr("op", "sum") != "sum":
        raise UnsupportedChain(f"all_reduce op {anchor.attr('op')!r} is not 'sum'")
    source, reduced = anchor.inputs[0], anchor.outputs[0]
    side = tuple(n for n in external_inputs(graph, span.epilogue) if n != reduced)
    chain_inputs = (reduced,) + side
    returns_reduced = reduced in span.outputs
    chain_outputs = tuple(n for n in span.outputs if n != reduced)
    chain = chain_from_nodes(span.nodes(span.epilogue), chain_inputs, chain_outputs)

    anchor_meta = _meta(meta, reduced)
    shape = tuple(anchor_meta.shape)
    numel = math.prod(shape)
    if not 0 < numel < INT32_LIMIT:
        raise UnsupportedChain(f"{numel} elements is outside (0, 2**31)")
    cols = shape[-1] if shape else 1
    if chain.rowwise and next_power_of_2(cols) > MAX_ROW_BLOCK:
        raise UnsupportedChain(f"rows of {cols} elements are too long for one tile")
    # in slot order: the chain numbers the nodes' results as they come
    produced = [n for i in span.epilogue for n in graph.nodes[i].outputs]
    for name in (source,) + chain_inputs + tuple(produced):
        m = _meta(meta, name)
        if m.dtype not in FLOAT_DTYPES and name not in produced:  # fp8 out: checked below
            raise UnsupportedChain(f"{name!r} is {m.dtype}; needs float16, bfloat16 or float32")
        if m.device != anchor_meta.device:
            raise UnsupportedChain(f"{name!r} is on {m.device}, the reduction on "
                                   f"{anchor_meta.device}")
    for slot, name in enumerate(produced, start=len(chain_inputs)):
        expected = chain.value_shape(slot, shape)  # a per-row value is [..., 1]
        if tuple(meta[name].shape) != expected:
            raise UnsupportedChain(f"{name!r} has shape {tuple(meta[name].shape)}, not {expected}")
    for name, kind in zip(chain_inputs, chain.inputs):
        side_shape = tuple(meta[name].shape)
        if kind == "weight" and side_shape != (cols,):
            raise UnsupportedChain(f"weight {name!r} has shape {side_shape}, not ({cols},)")
        try:
            broadcast = tuple(broadcast_shape((side_shape, shape)))
        except ValueError:
            broadcast = None
        if kind == "row" and broadcast != shape:
            raise UnsupportedChain(f"{name!r} of shape {side_shape} does not broadcast to {shape}")
    dtypes = chain.output_dtypes([meta[n].dtype for n in chain_inputs])
    if dtypes != [meta[n].dtype for n in chain_outputs]:
        raise UnsupportedChain("output dtypes differ from the references'")
    in_place = None
    if not returns_reduced:  # an output the reduced buffer can hold: its dtype and shape
        in_place = next((i for i, (d, s) in enumerate(zip(dtypes, chain.output_shapes(shape)))
                         if d == anchor_meta.dtype and s == shape), None)
    return _Plan(source, reduced, chain, chain_inputs, chain_outputs, returns_reduced, in_place)


def _on(device: torch.device):
    # Triton launches on the current device, and the engine compiles in worker threads.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _current_device_check(device: torch.device):
    """A cheap `device is the current device` test: switching devices costs more than asking."""
    if device.type != "cuda":
        return lambda: True
    if device.index is None:
        return lambda: False
    return lambda: torch.cuda.current_device() == device.index


class NcclEpilogueAlgorithm(Algorithm):
    name = "nccl+nt_epilogue"

    def supports(self, span, meta, ctx) -> bool:
        if ctx.device.type != "cuda":
            return False
        try:
            p = plan(span, meta)
        except UnsupportedChain:
            return False
        return meta[p.reduced].device.type == "cuda"

    def compile(self, span, meta, ctx):
        p = plan(span, meta)
        from infini_dist.kernels.elementwise_chain import prepare
        device = meta[p.reduced].device
        group = ctx.group
        with _on(device):  # builds the kernel
            launch = prepare(p.chain, [meta[n].shape for n in p.chain_inputs],
                             [meta[n].dtype for n in p.chain_inputs],
                             fast_launch=ctx.settings.fast_launch if ctx.settings else True)
        sides = p.chain_inputs[1:]  # the reduced value comes first
        count = len(p.chain_outputs)
        on_device = _current_device_check(device)

        def run(env):
            with contextlib.nullcontext() if on_device() else _on(device):
                reduced = env[p.source].clone(memory_format=torch.contiguous_format)
                dist.all_reduce(reduced, group=group)
                outs = [None] * count
                if p.in_place is not None:
                    outs[p.in_place] = reduced
                results = launch([reduced] + [env[n] for n in sides], outs)
            values = dict(zip(p.chain_outputs, results))
            if p.returns_reduced:
                values[p.reduced] = reduced
            return values

        # Compile now, by one launch on scratch tensors (no collective), the same way `run` will.
        with _on(device):
            scratch = [torch.ones(meta[n].shape, dtype=meta[n].dtype, device=device)
                       for n in p.chain_inputs]
            outs = [None] * len(p.chain_outputs)
            if p.in_place is not None:
                outs[p.in_place] = scratch[0]
            launch(scratch, outs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run
