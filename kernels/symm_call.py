"""The symmetric-memory all-reduce kernels as plain functions, the way kraken offers its kernels:
each kernel file ends with one `SymmKernel`, e.g. `one_shot_all_reduce`, callable as
`one_shot_all_reduce(x, group=g, prologue=(("relu",),), epilogue=(("scale", 0.5),))`. It also
tells the engine's algorithm adapters (scheduler/backends/symm.py) what they need: its buffer
kind, its launch builder and its buffer size. The argument checks and output allocation below
serve every plain callable, reduce_scatter_all_gather's (not a SymmKernel: another signature) too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.rows import FLOAT_DTYPES
from infini_dist.kernels.symm_chain import (CODES, MAX_CHAIN, MAX_ROW, NO_NORM, NORM_CODES,
                                            QUANT_CODES, STEPS, ChainOp)
from infini_dist.kernels.symm_device import DEFAULT_TUNING

# The norms a weight may select: those of a value (add_rms_norm is rms_norm with `residual`).
_NORM_ROLES = {name: SPECS[name].symm_norm.roles for name in NORM_CODES
               if "residual" not in SPECS[name].symm_norm.roles}

# Chain steps by name (symm_chain.STEPS, from the op specs): (name,), (name, number) for a step
# with a scalar (scale), (name, tensor) for one with a side operand: a tensor of x's shape, or
# for a "vector" step (bias_add) a 1-D tensor over x's last dim.
# swiglu_gate: silu(y) * side; swiglu_up: silu(side) * y.


def _like(name: str, tensor, x, shape=None) -> None:
    shape = x.shape if shape is None else shape
    if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or tensor.dtype != x.dtype:
        raise ValueError(f"{name} must be a tensor of shape {tuple(shape)} and dtype {x.dtype}")


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
        spec = STEPS[name]
        wanted = 1 if spec.side is not None or spec.scalar is not None else 0
        if len(operands) != wanted:
            raise ValueError(f"chain step {name!r} takes {wanted} operand(s), got {len(operands)}")
        if spec.scalar is not None:
            ops.append(ChainOp(CODES[name], float(operands[0])))
        elif spec.side is not None:
            vector = spec.side == "vector"
            _like(f"the side of {name!r}", operands[0], x, x.shape[-1:] if vector else None)
            key = f"side{len(sides)}"
            sides[key] = operands[0].contiguous()
            ops.append(ChainOp(CODES[name], float(x.shape[-1]) if vector else 0.0, key))
        else:
            ops.append(ChainOp(CODES[name]))
    return tuple(ops)


@dataclass(frozen=True)
class SymmKernel:
    kind: str           # buffer key: launches of one protocol share buffers, others never do
    launch: Callable    # (x, buffer, out, *, tuning: SymmTuning, **symm_chain.fused_arguments
    #                     options) -> (kernel, grid, args, kwargs)
    data_bytes: Callable  # (numel, element_size, world_size, row_len, norm) -> bytes per call
    lamport: bool       # polled buffers: they start empty (symm_buffers.fill_empty)

    def lamport_width(self, dtype: torch.dtype) -> int:
        """The buffers' empty-pattern width for `dtype` (0: not polled); part of their key."""
        return dtype.itemsize * 8 if self.lamport else 0

    def __call__(self, x, *, group=None, prologue=(), epilogue=(), weight=None, residual=None,
                 eps=1e-6, buffer=None, norm="rms_norm", bias=None, tuning=DEFAULT_TUNING,
                 quant=None):
        """`x` summed over `group` by this kernel, its prologue and epilogue fused. Collective:
        every rank of `group` calls it with the same shapes, dtypes and steps. Unfused torch
        equivalent (every step computes in fp32 and rounds to x.dtype):

            y = x.clone()
            for step in prologue: y = step(y)
            dist.all_reduce(y, group=group)
            for step in epilogue: y = step(y)
            if residual is not None:                 # returns (out, new residual)
                residual = y + residual; return rms_norm(residual, weight, eps), residual
            y = rms_norm(y, weight, eps) if weight is not None else y
            return quantizer(y) if quant is not None else y   # then (q[, scales][, residual])

        `norm` names the norm a weight selects: any op of symm_chain.NORM_CODES, e.g.
        "gemma_rms_norm", or "layer_norm" (with `bias`); a residual is added before any of them.

        Steps: up to three of STEPS, e.g. ("relu",), ("scale", 0.5), ("mul", up). The sums are
        fp32 in a fixed order, so every rank gets the same bits. `buffer`: a
        symm_buffers.SymmBuffer to use (default: this kernel's cached symmetric buffer of
        `group`, allocated on first use, which needs CUDA). `tuning`: a symm_device.SymmTuning,
        the same on every rank.

        `quant`: an output quantizer of symm_chain.QUANT_CODES, last: ("quant_fp8", scale)
        (static per-tensor FP8: the output is float8_e4m3fn, the residual keeps x.dtype),
        ("quant_fp8_tensor_scale", scale) (the same, `scale` a one-element tensor read at run
        time) or ("quant_fp8_per_token"[, min_scale]) (after a norm; its fp32 scales, rows x 1,
        follow the output; `_reciprocal`: multiplied by their reciprocal)."""
        kernel, grid, args, kwargs, results = self.bind(
            x, group=group, prologue=prologue, epilogue=epilogue, weight=weight,
            residual=residual, eps=eps, buffer=buffer, norm=norm, bias=bias, tuning=tuning,
            quant=quant)
        kernel[grid](*args, **kwargs)
        return results if len(results) > 1 else results[0]

    def bind(self, x, *, group=None, prologue=(), epilogue=(), weight=None, residual=None,
             eps=1e-6, buffer=None, norm="rms_norm", bias=None, tuning=DEFAULT_TUNING,
             quant=None):
        """What a call launches, unlaunched: (kernel, grid, args, kwargs, results), `results`
        being what the call returns as a tuple (out[, scales][, pre]), for the same arguments
        (tests compile it with `kernel.warmup(*args, grid=grid, **kwargs)`)."""
        x = checked_input(x)
        sides = {}
        options = dict(prologue=chain_ops(prologue, x, sides),
                       epilogue=chain_ops(epilogue, x, sides), sides=sides, eps=float(eps),
                       **norm_options(x, norm, weight, bias, residual), **quant_options(quant))
        data_bytes = self.data_bytes(x.numel(), x.element_size(), world_size_of(group, buffer),
                                     options.get("row_len"), options["norm"])
        buffer = call_buffer(buffer, group, x.device, self.kind, data_bytes,
                             self.lamport_width(x.dtype))
        out, scales, pre = call_outputs(x, quant, residual)
        kernel, grid, args, kwargs = self.launch(x, buffer, out, pre=pre, scales=scales,
                                                 tuning=tuning, **options)
        return kernel, grid, args, kwargs, tuple(t for t in (out, scales, pre) if t is not None)


# ---- what every plain callable checks and allocates (here and reduce_scatter_all_gather) ------

def checked_input(x):
    """`x` contiguous, or ValueError where no kernel takes it."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() == 0 \
            or x.numel() == 0:
        raise ValueError("x must be a non-empty float16, bfloat16 or float32 tensor of at least "
                         "one dim")
    return x.contiguous()


def call_buffer(buffer, group, device, kind: str, data_bytes: int, lamport_width: int = 0):
    """`buffer` if it holds `data_bytes`, else ValueError; None: the cached symmetric buffer of
    `kind` for `group` (collective on first use)."""
    if buffer is None:
        return symm_buffers.get_buffer(group, device, kind, data_bytes, lamport_width)
    if buffer.data_bytes < data_bytes:
        raise ValueError(f"the buffer holds {buffer.data_bytes} bytes, this call needs "
                         f"{data_bytes}")
    return buffer


def call_outputs(like, quant, residual) -> tuple:
    """(out, scales, pre) of `like`'s shape for a call's `quant` and `residual`, None where not
    written: `out` in the quantizer's dtype, a per-row quantizer's fp32 scales rows x 1."""
    quantizer = SPECS[quant[0]] if quant is not None else None
    out = torch.empty_like(like, dtype=quantizer.out_dtype if quantizer else like.dtype)
    pre = torch.empty_like(like) if residual is not None else None
    scales = None
    if quantizer is not None and quantizer.symm_quant.row_scale:
        scales = torch.empty(like.shape[:-1] + (1,), dtype=torch.float32, device=like.device)
    return out, scales, pre


def quant_options(quant) -> dict:
    """The launch options of `quant`: None, or (name,) / (name, scale) of a spec'd quantizer,
    the scale a number, or a one-element tensor for one that reads it at run time."""
    if quant is None:
        return {}
    name, *operands = quant
    if name not in QUANT_CODES:
        raise ValueError(f"unknown quantizer {name!r}; known: {sorted(QUANT_CODES)}")
    quantizer = SPECS[name].symm_quant
    if quantizer.scale_operand:
        if len(operands) != 1:
            raise ValueError(f"quantizer {name!r} takes its scale tensor, got {len(operands)} "
                             "operand(s)")
        return {"quant": QUANT_CODES[name], "quant_scale": operands[0]}  # fused_arguments checks
    if quantizer.scalar is None:
        if operands:
            raise ValueError(f"quantizer {name!r} takes no operand, got {len(operands)}")
        return {"quant": QUANT_CODES[name]}
    # A per-row quantizer's floor has a natural default; a static scale has none (a scale left
    # out would quantize by 1.0: a wrong answer, not an error).
    if len(operands) > 1 or (not operands and not quantizer.row_scale):
        raise ValueError(f"quantizer {name!r} takes its {quantizer.scalar}"
                         f"{' or nothing (the default)' if quantizer.row_scale else ''}, got "
                         f"{len(operands)} operand(s)")
    value = operands[0] if operands else dict(SPECS[name].attrs)[quantizer.scalar]
    return {"quant": QUANT_CODES[name], "quant_scale": float(value)}


def norm_options(x, norm, weight, bias, residual) -> dict:
    """The launch options of a norm `weight` selects (none without one), operands checked
    against `x`'s shape (a residual: `x`'s shape and dtype)."""
    if weight is None:
        if residual is not None or bias is not None:
            raise ValueError("a residual or a bias needs a weight: they feed the norm")
        return {"norm": NO_NORM.value}
    row_len = x.shape[-1]
    if weight.shape != (row_len,) or not weight.dtype.is_floating_point or row_len > MAX_ROW:
        raise ValueError(f"weight must be a float tensor of shape ({row_len},), with rows of at "
                         f"most {MAX_ROW}")
    roles = _NORM_ROLES.get(norm)
    if roles is None:
        raise ValueError(f"unknown norm {norm!r}; known: {sorted(_NORM_ROLES)}")
    if (bias is not None) != ("bias" in roles):
        raise ValueError(f"norm {norm!r} {'needs' if 'bias' in roles else 'takes no'} bias")
    options = {"norm": NORM_CODES[norm], "weight": weight.contiguous(), "row_len": row_len}
    if bias is not None:
        _like("bias", bias, weight, weight.shape)
        options["bias"] = bias.contiguous()
    if residual is not None:
        _like("residual", residual, x)
        options["residual"] = residual.contiguous()
    return options


def world_size_of(group, buffer) -> int:
    """The ranks a call spans: the buffer's, else the group's."""
    if buffer is not None:
        return buffer.world_size
    import torch.distributed as dist
    return dist.get_world_size(group)
