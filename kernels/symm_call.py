"""The symmetric-memory all-reduce kernels as plain functions, the way kraken offers its kernels:
each kernel file ends with one `SymmKernel`, e.g. `one_shot_all_reduce`, callable as
`one_shot_all_reduce(x, group=g, prologue=(("relu",),), epilogue=(("scale", 0.5),))`. It also
tells the engine's algorithm adapters (scheduler/backends/symm.py) what they need: its buffer
kind, its launch builder and its buffer size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.rows import FLOAT_DTYPES
from infini_dist.kernels.symm_chain import (ADD, ADD_RMS_NORM, GELU, GELU_TANH, MAX_CHAIN,
                                            MAX_ROW, MUL, NO_NORM, RELU, RMS_NORM, SCALE, SIGMOID,
                                            SILU, SWIGLU_GATE, SWIGLU_UP, ChainOp)


# Chain steps by name: (name,) or ("scale", s) or (name, side tensor) for the binary ops.
# swiglu_gate: silu(y) * side; swiglu_up: silu(side) * y.
STEPS = {"relu": RELU, "silu": SILU, "sigmoid": SIGMOID, "gelu": GELU, "gelu_tanh": GELU_TANH,
         "scale": SCALE, "add": ADD, "mul": MUL, "swiglu_gate": SWIGLU_GATE,
         "swiglu_up": SWIGLU_UP}
_SIDED = {ADD.value, MUL.value, SWIGLU_GATE.value, SWIGLU_UP.value}


def _like(name: str, tensor, x) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.shape != x.shape or tensor.dtype != x.dtype:
        raise ValueError(f"{name} must be a tensor of x's shape {tuple(x.shape)} and dtype "
                         f"{x.dtype}")


def chain_ops(steps, x, sides: dict) -> tuple:
    """The ChainOps of `steps`; their side tensors go into `sides` under fresh names."""
    steps = tuple(steps)
    if len(steps) > MAX_CHAIN:
        raise ValueError(f"at most {MAX_CHAIN} chain steps, got {len(steps)}")
    ops = []
    for step in steps:
        name, *operands = step
        if name not in STEPS:
            raise ValueError(f"unknown chain step {name!r}; known: {sorted(STEPS)}")
        code = STEPS[name].value
        wanted = 1 if code in _SIDED or code == SCALE.value else 0
        if len(operands) != wanted:
            raise ValueError(f"chain step {name!r} takes {wanted} operand(s), got {len(operands)}")
        if code == SCALE.value:
            ops.append(ChainOp(code, float(operands[0])))
        elif code in _SIDED:
            _like(f"the side of {name!r}", operands[0], x)
            key = f"side{len(sides)}"
            sides[key] = operands[0].contiguous()
            ops.append(ChainOp(code, side=key))
        else:
            ops.append(ChainOp(code))
    return tuple(ops)


@dataclass(frozen=True)
class SymmKernel:
    kind: str           # buffer key: launches of one protocol share buffers, others never do
    launch: Callable    # (x, buffer, out, **symm_chain.fused_arguments options) ->
    #                     (kernel, grid, args, kwargs)
    data_bytes: Callable  # (numel, element_size, world_size, row_len, norm) -> bytes per call
    lamport: bool       # polled buffers: they start empty (symm_buffers.fill_empty)

    def lamport_width(self, dtype: torch.dtype) -> int:
        """The buffers' empty-pattern width for `dtype` (0: not polled); part of their key."""
        return dtype.itemsize * 8 if self.lamport else 0

    def __call__(self, x, *, group=None, prologue=(), epilogue=(), weight=None, residual=None,
                 eps=1e-6, buffer=None):
        """`x` summed over `group` by this kernel, its prologue and epilogue fused. Collective:
        every rank of `group` calls it with the same shapes, dtypes and steps. Unfused torch
        equivalent (every step computes in fp32 and rounds to x.dtype):

            y = x.clone()
            for step in prologue: y = step(y)
            dist.all_reduce(y, group=group)
            for step in epilogue: y = step(y)
            if residual is not None:                 # returns (out, new residual)
                residual = y + residual; return rms_norm(residual, weight, eps), residual
            return rms_norm(y, weight, eps) if weight is not None else y

        Steps: up to three of STEPS, e.g. ("relu",), ("scale", 0.5), ("mul", up). The sums are
        fp32 in a fixed order, so every rank gets the same bits. `buffer`: a
        symm_buffers.SymmBuffer to use (default: this kernel's cached symmetric buffer of
        `group`, allocated on first use, which needs CUDA)."""
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() == 0 \
                or x.numel() == 0:
            raise ValueError("x must be a non-empty float16, bfloat16 or float32 tensor")
        x = x.contiguous()
        sides = {}
        options = dict(prologue=chain_ops(prologue, x, sides),
                       epilogue=chain_ops(epilogue, x, sides), sides=sides, eps=float(eps),
                       **_norm_options(x, weight, residual))
        data_bytes = self.data_bytes(x.numel(), x.element_size(), _world_size(group, buffer),
                                     options.get("row_len"), options["norm"])
        if buffer is None:
            buffer = symm_buffers.get_buffer(group, x.device, self.kind, data_bytes,
                                             self.lamport_width(x.dtype))
        elif buffer.data_bytes < data_bytes:
            raise ValueError(f"the buffer holds {buffer.data_bytes} bytes, this call needs "
                             f"{data_bytes}")
        out = torch.empty_like(x)
        pre = torch.empty_like(x) if residual is not None else None
        kernel, grid, args, kwargs = self.launch(x, buffer, out, pre=pre, **options)
        kernel[grid](*args, **kwargs)
        return (out, pre) if pre is not None else out


def _norm_options(x, weight, residual) -> dict:
    if weight is None:
        if residual is not None:
            raise ValueError("a residual needs a weight: it feeds add + rms_norm")
        return {"norm": NO_NORM.value}
    row_len = x.shape[-1]
    if weight.shape != (row_len,) or not weight.dtype.is_floating_point or row_len > MAX_ROW:
        raise ValueError(f"weight must be a float tensor of shape ({row_len},), with rows of at "
                         f"most {MAX_ROW}")
    options = {"norm": RMS_NORM.value, "weight": weight.contiguous(), "row_len": row_len}
    if residual is not None:
        _like("residual", residual, x)
        options.update(norm=ADD_RMS_NORM.value, residual=residual.contiguous())
    return options


def _world_size(group, buffer) -> int:
    if buffer is not None:
        return buffer.world_size
    import torch.distributed as dist
    return dist.get_world_size(group)
