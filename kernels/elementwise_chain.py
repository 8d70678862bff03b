"""Any chain of elementwise ops (optionally with row norms) as ONE kernel: one read of every
input, one write of every output, fp32 in between, one rounding per stored value.

Unfused torch, for the chain add -> relu -> scale(0.5) (see `infini_dist.kernels.chain`):
    b = (a.float() + r.float()).to(a.dtype); c = torch.relu(b)
    out = (c.float() * 0.5).to(a.dtype)

The chain's application is generated Python (ninetoothed applications are Python functions, read
back with `inspect.getsource`, so the source is registered with linecache), one per chain and
tile width, and calls the per-op helpers of kernels/nt_device.py, which ninetoothed inlines.
"""

from __future__ import annotations

import functools
import hashlib
import linecache

import ninetoothed.language as ntl
import torch
from ninetoothed import Tensor

from infini_dist.kernels import nt_device, nt_runtime
from infini_dist.kernels.chain import Chain
from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.rows import (arrangement, as_rows, broadcast_shape, check_dtypes,
                                      check_float_dtypes, elementwise_views, num_warps, output,
                                      row_blocks, tiled_premake)


def _helpers(chain: Chain) -> dict:
    """The nt_device helpers the chain's steps call (their specs' `nt_helpers`)."""
    return {name: getattr(nt_device, name)
            for step in chain.steps for name in SPECS[step.op].nt_helpers}


def _step_code(step, args, results):
    """Statements computing one step (its spec's `nt_code`). Every helper call is a whole
    right-hand side: ninetoothed 0.26 drops the inlined body of a call nested inside an
    expression."""
    return SPECS[step.op].nt_code(step, args, results)


def application_source(chain: Chain, block_n: int | None) -> str:
    inputs = [f"in_{i}" for i in range(len(chain.inputs))]
    outputs = [f"out_{i}" for i in range(len(chain.outputs))]
    params = inputs + (["num_cols"] if chain.rowwise else []) + outputs
    body = [f"v_{i} = ntl.cast({name}, ntl.float32)" for i, name in enumerate(inputs)]
    if chain.rowwise:
        # Lanes past the row end hold whatever the steps made of zeros; the sums must skip them.
        body.append(f"in_row = ntl.arange(0, {block_n})[None, :] < num_cols")
    for step, slots in zip(chain.steps, chain.result_slots()):
        body += _step_code(step, [f"v_{s}" for s in step.reads], [f"v_{s}" for s in slots])
    body += [f"{name} = v_{slot}" for name, slot in zip(outputs, chain.outputs)]
    lines = [f"def chain_application({', '.join(params)}):"] + [f"    {line}" for line in body]
    return "\n".join(lines) + "\n"


@functools.cache
def _application(chain: Chain, block_n: int | None):
    source = application_source(chain, block_n)
    filename = f"<infini_dist chain {hashlib.sha256(source.encode()).hexdigest()[:16]}>"
    # ninetoothed reads the application back with inspect.getsource.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"ntl": ntl, **_helpers(chain)}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["chain_application"]


def premake(chain: Chain, block_m: int, block_n: int):
    if chain.rowwise:
        tensors = ([Tensor(2 if kind == "row" else 1, other=0.0) for kind in chain.inputs]
                   + [Tensor(0)] + [Tensor(2) for _ in chain.outputs])
        first_output = len(chain.inputs) + 1  # after the inputs and num_cols
        per_row = tuple(first_output + i for i, slot in enumerate(chain.outputs)
                        if slot in chain.per_row_slots())
        return tiled_premake(arrangement, _application(chain, block_n), tuple(tensors), block_m,
                             block_n, per_row=per_row)
    tensors = [Tensor(2) for _ in chain.inputs] + [Tensor(2) for _ in chain.outputs]
    return tiled_premake(arrangement, _application(chain, None), tuple(tensors), block_m, block_n)


@functools.cache
def make(chain: Chain, block_m: int, block_n: int, num_warps: int):
    return nt_runtime.make(premake(chain, block_m, block_n), num_warps)


def prepare(chain: Chain, input_shapes, input_dtypes, fast_launch: bool = True):
    """Everything about running `chain` that depends only on its inputs' shapes and dtypes (checks,
    output dtypes, tile shape, the kernel). Returns `launch(inputs, outs=None) -> outputs` for
    inputs of exactly those shapes; `outs` may give some outputs (None entries: allocate).
    `fast_launch=False` keeps every launch on Triton's normal path (for A/B timing)."""
    input_shapes = [tuple(shape) for shape in input_shapes]
    if len(input_shapes) != len(chain.inputs):
        raise ValueError(f"the chain takes {len(chain.inputs)} inputs, got {len(input_shapes)}")
    check_float_dtypes(input_dtypes)
    rows_in = [s for s, kind in zip(input_shapes, chain.inputs) if kind == "row"]
    if not rows_in:
        raise ValueError("the chain reads no row input")
    shape = broadcast_shape(rows_in)
    cols = shape[-1] if len(shape) else 1
    for s, kind in zip(input_shapes, chain.inputs):
        if kind == "weight" and s != (cols,):
            raise ValueError(f"a weight has shape {s}, expected ({cols},)")
    dtypes = chain.output_dtypes(input_dtypes)
    # per output: the chain's shape, or [..., 1] for a per-row one (only in a rowwise chain)
    out_shapes = [torch.Size(s) for s in chain.output_shapes(shape)]
    kinds, rowwise = chain.inputs, chain.rowwise
    first_row = kinds.index("row")
    kernels = {}

    def kernel_for(block_m, block_n):
        kernel = kernels.get((block_m, block_n))
        if kernel is None:
            kernel = kernels[block_m, block_n] = make(chain, block_m, block_n,
                                                      num_warps(block_m, block_n))
        return kernel

    if rowwise and shape.numel():
        rows_kernel = kernel_for(*row_blocks(shape.numel() // cols, cols))

    def normal(inputs, outs):
        if [tuple(t.shape) for t in inputs] != input_shapes:
            raise ValueError(f"inputs of shapes {[tuple(t.shape) for t in inputs]}; this launch "
                             f"was prepared for {input_shapes}")
        outs = [output(o, s, d, inputs[first_row].device, f"outs[{i}]")
                for i, (o, s, d) in enumerate(zip(outs or [None] * len(dtypes), out_shapes,
                                                  dtypes))]
        if shape.numel() == 0:
            return outs
        if not rowwise:
            views, block_m, block_n = elementwise_views(inputs, outs, shape)
            kernel_for(block_m, block_n)(*views)
            return outs
        args = [as_rows(t, shape) if kind == "row" else t for t, kind in zip(inputs, kinds)]
        rows_kernel(*args, cols, *[as_rows(o, s, written=True) for o, s in zip(outs, out_shapes)])
        return outs

    # The fast path (nt_runtime.FastLaunch) takes calls whose every tensor is contiguous and of
    # its prepared shape, with no broadcast input: their 2-D views, so the kernel's sizes and
    # strides, are the same at every call, and the kernel needs only their addresses. It is
    # built at the second such call, so a one-off launch (`elementwise_chain`) never pays for it.
    sizes = [torch.Size(s) for s in input_shapes]
    fast_shapes = fast_launch and shape.numel() > 0 and all(
        s == shape for s, kind in zip(input_shapes, kinds) if kind == "row")
    state = {"calls": 0, "fast": None}

    def build_fast(inputs, outs):
        # views: what the normal path passes, each a distinct object for fast_launch to trace
        if not rowwise:
            views, block_m, block_n = elementwise_views(inputs, outs, shape)
            kernel, args = kernel_for(block_m, block_n), views
        else:
            views = ([as_rows(t, shape) if kind == "row" else t.view(t.shape)
                      for t, kind in zip(inputs, kinds)]
                     + [as_rows(o, s, written=True) for o, s in zip(outs, out_shapes)])
            kernel, args = rows_kernel, views[:len(inputs)] + [cols] + views[len(inputs):]
        if any(v.data_ptr() != t.data_ptr() for v, t in zip(views, list(inputs) + outs)):
            return None  # a copy, not a view: the callers' tensors cannot stand in for it
        return nt_runtime.fast_launch(kernel, args, views)

    def launch(inputs, outs=None):
        if not fast_shapes or len(inputs) != len(sizes):
            return normal(inputs, outs)
        for t, size in zip(inputs, sizes):
            if t.shape != size or not t.is_contiguous():
                return normal(inputs, outs)
        like = inputs[first_row]
        outs = list(outs) if outs else [None] * len(dtypes)
        if len(outs) != len(dtypes):
            return normal(inputs, outs)
        for i, (o, s, d) in enumerate(zip(outs, out_shapes, dtypes)):
            if o is None:
                outs[i] = (torch.empty_like(like, dtype=d) if s == shape
                           else torch.empty(s, dtype=d, device=like.device))
            elif o.shape != s or o.dtype is not d or not o.is_contiguous():
                return normal(inputs, outs)
        fast = state["fast"]
        if fast is None:
            state["calls"] += 1
            if state["calls"] < 2:
                return normal(inputs, outs)
            fast = state["fast"] = build_fast(inputs, outs) or False
        if fast is False:
            return normal(inputs, outs)
        fast(*inputs, *outs)
        return outs

    launch.state = state  # tests look at state["fast"]
    return launch


def elementwise_chain(chain: Chain, *inputs: torch.Tensor, outs=None) -> list[torch.Tensor]:
    """Run `chain` on `inputs` (one tensor per input slot). Returns one tensor per chain output,
    of the row inputs' broadcast shape (a per-row output: that shape with a last dim of 1);
    `outs` may give some or all of them (None: allocate)."""
    check_dtypes(*inputs)
    launch = prepare(chain, [t.shape for t in inputs], [t.dtype for t in inputs])
    if outs is not None and len(outs) != len(chain.outputs):
        raise ValueError(f"the chain stores {len(chain.outputs)} outputs, got {len(outs)} outs")
    return launch(inputs, outs)
