"""Elementwise chains and row norms inside the symmetric-memory all-reduce kernels.

A chain is up to three ops, each an op code (constexpr), a scalar and a side-tensor pointer. It
is the same encoding for the prologue (applied to the local input as it is pushed into symmetric
memory) and for the epilogue (applied to the reduced value). Every op computes in fp32 and
rounds once to the tensor dtype, which is exactly what the unfused references in
`scheduler/op_registry.py` do, so a fused chain and the unfused graph agree to the last bit wherever
the transcendental functions agree.

Unfused equivalent of an epilogue `relu, scale(s)` followed by add_rms_norm:
    y = all_reduce(x); y = relu(y); y = y * s
    out, residual = rms_norm(y + residual) * weight, y + residual
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl

from infini_dist.kernels.symm_signal import world_size_pow2

# op codes; SWIGLU_GATE: the chain value is the gate (silu(x) * side); SWIGLU_UP: it is the up
# projection (silu(side) * x).
# (tl.constexpr so that kernels may read them; `.value` is the plain int.)
NONE, ADD, MUL, SCALE, RELU, SILU, GELU, GELU_TANH, SIGMOID, SWIGLU_GATE, SWIGLU_UP = (
    tl.constexpr(code) for code in range(11))
MAX_CHAIN = 3

# norm codes: RMS_NORM normalises the (rounded) chain value; ADD_RMS_NORM adds the residual in
# fp32, normalises that sum and also yields it rounded.
NO_NORM, RMS_NORM, ADD_RMS_NORM = (tl.constexpr(code) for code in range(3))

_UNARY = {"relu": RELU.value, "silu": SILU.value, "sigmoid": SIGMOID.value}
_BINARY = {"add": ADD.value, "mul": MUL.value}


@dataclass(frozen=True)
class ChainOp:
    code: int
    scalar: float = 0.0
    side: str | None = None  # name of the side tensor in the env


def encode_node(node, chain_value: str) -> ChainOp | None:
    """The ChainOp for an elementwise node applied to `chain_value`, or None if we lack it."""
    op = node.op_type
    others = [n for n in node.inputs if n != chain_value]
    if node.inputs.count(chain_value) != 1:
        return None  # e.g. mul(y, y): the chain value twice
    if op in _UNARY and not others:
        return ChainOp(_UNARY[op])
    if op == "scale" and not others:
        scale = node.attr("scale", 1.0)
        return ChainOp(SCALE.value, float(scale)) if isinstance(scale, (int, float)) else None
    if op == "gelu" and not others:
        approximate = node.attr("approximate", "none")
        return {"none": ChainOp(GELU.value), "tanh": ChainOp(GELU_TANH.value)}.get(approximate)
    if op in _BINARY and len(others) == 1:
        return ChainOp(_BINARY[op], side=others[0])
    if op == "swiglu" and len(others) == 1:
        code = SWIGLU_GATE.value if node.inputs[0] == chain_value else SWIGLU_UP.value
        return ChainOp(code, side=others[0])
    return None


def chain_arguments(ops: tuple, env: dict, dummy) -> tuple[tuple, tuple]:
    """One chain as kernel arguments, padded with NONE ops: (scalar0, side0, scalar1, side1,
    scalar2, side2) and the constexpr op codes (OP0, OP1, OP2)."""
    values, codes = (), ()
    for i in range(MAX_CHAIN):
        op = ops[i] if i < len(ops) else ChainOp(NONE.value)
        values += (float(op.scalar), env[op.side] if op.side is not None else dummy)
        codes += (op.code,)
    return values, codes


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE -> fp32: the one rounding every unfused op makes."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def apply_op(x, OP: tl.constexpr, scalar, side_ptr, index, mask, DTYPE: tl.constexpr):
    if OP == ADD or OP == MUL or OP == SWIGLU_GATE or OP == SWIGLU_UP:
        side = tl.load(side_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if OP == NONE:
        y = x  # already rounded: rounding again below changes nothing
    elif OP == ADD:
        y = x + side
    elif OP == MUL:
        y = x * side
    elif OP == SCALE:
        y = x * scalar
    elif OP == RELU:
        y = tl.maximum(x, 0.0)
    elif OP == SILU:
        y = x * _sigmoid(x)
    elif OP == GELU:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif OP == GELU_TANH:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (1.0 + (2.0 * _sigmoid(2.0 * inner) - 1.0))  # tanh(u) = 2 sigmoid(2u) - 1
    elif OP == SIGMOID:
        y = _sigmoid(x)
    elif OP == SWIGLU_GATE:
        y = x * _sigmoid(x) * side
    else:  # SWIGLU_UP
        y = side * _sigmoid(side) * x
    return round_to(y, DTYPE)


@triton.jit
def apply_chain(x, index, mask, OP0: tl.constexpr, scalar0, side0, OP1: tl.constexpr, scalar1,
                side1, OP2: tl.constexpr, scalar2, side2, DTYPE: tl.constexpr):
    x = apply_op(x, OP0, scalar0, side0, index, mask, DTYPE)
    x = apply_op(x, OP1, scalar1, side1, index, mask, DTYPE)
    return apply_op(x, OP2, scalar2, side2, index, mask, DTYPE)


@triton.jit
def finish_item(y, index, column, mask, out_ptr, pre_ptr, weight_ptr, residual_ptr, eps,
                E_OP0: tl.constexpr, e_scalar0, e_side0, E_OP1: tl.constexpr, e_scalar1, e_side1,
                E_OP2: tl.constexpr, e_scalar2, e_side2,
                NORM: tl.constexpr, WRITE_PRE: tl.constexpr, ROW_LEN: tl.constexpr):
    """Epilogue of one item (a row when NORM != NO_NORM) from its reduced value `y` (fp32, already
    rounded to the output dtype like the all_reduce output), then its stores. `y` may also be a
    [group, row] tile of several items; `column` then is [1, row]."""
    y = apply_chain(y, index, mask, E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1,
                    E_OP2, e_scalar2, e_side2, out_ptr.dtype.element_ty)
    if NORM == NO_NORM:
        tl.store(out_ptr + index, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if NORM == ADD_RMS_NORM:
            y = y + tl.load(residual_ptr + index, mask=mask, other=0.0).to(tl.float32)
        if WRITE_PRE:
            tl.store(pre_ptr + index, y.to(out_ptr.dtype.element_ty), mask=mask)
        y = tl.where(mask, y, 0.0)
        inverse = tl.math.rsqrt(tl.sum(y * y, axis=-1, keep_dims=True) / ROW_LEN + eps)
        weight = tl.load(weight_ptr + column, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + index, (y * inverse * weight).to(out_ptr.dtype.element_ty), mask=mask)


# ---- host side: how a tensor is cut into items and programs --------------------------------------

# Programs per launch: at most one per SM (132 on an H100/H200), so that every program of a
# launch is resident and program b of each rank can wait for program b of its peers.
MAX_PROGRAMS = 128
ELEMENTWISE_BLOCK = 4096
MAX_ROW = 32768  # a whole row sits in one program's registers


@dataclass(frozen=True)
class Layout:
    item: int       # elements per item: a row (norm) or a chunk
    block: int      # next power of two of item
    grid: int       # programs; a pure function of the shape, so equal on every rank
    num_warps: int
    sub: int        # two-shot: elements of an item each rank reduces (a multiple of 16)
    sub_block: int


@functools.lru_cache(maxsize=1024)
def launch_layout(numel: int, row_len: int | None, norm: int, world_size: int) -> Layout:
    if norm != NO_NORM.value:
        if not row_len or numel % row_len or row_len > MAX_ROW:
            raise ValueError(f"row norm needs rows of at most {MAX_ROW} dividing {numel} "
                             f"elements, got row length {row_len}")
        item = row_len
        block = triton.next_power_of_2(item)
    else:
        block = item = min(ELEMENTWISE_BLOCK, max(128, triton.next_power_of_2(numel)))
    sub = triton.cdiv(triton.cdiv(item, world_size), 16) * 16
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    grid = max(1, min(triton.cdiv(numel, item), MAX_PROGRAMS))
    return Layout(item, block, grid, num_warps, sub, triton.next_power_of_2(sub))


def fused_arguments(x, buffer, out, *, prologue=(), epilogue=(), sides=None, norm=0,
                    weight=None, residual=None, eps=1e-6, pre=None, row_len=None):
    """What every fused symmetric-memory launch on `buffer` (symm_buffers.SymmBuffer) shares,
    as (layout, leading args, kwargs). `prologue` / `epilogue` are ChainOps whose side tensors
    are looked up in `sides`; `norm` is a norm code, with `weight` and (ADD_RMS_NORM) `residual`
    over rows of `row_len`. The kernel writes `out` and, if given, `pre` (the value the norm
    normalises, i.e. the new residual); x stands in for the pointers a launch does not use.
    Reads of the tensors: x.numel(), x.element_size() and x.is_cuda only, so the launch can be
    bound once and reused with other tensors of the same shape (scheduler/backends/symm.PreparedLaunch)."""
    layout = launch_layout(x.numel(), row_len, norm, buffer.world_size)
    p_values, p_codes = chain_arguments(prologue, sides, x)
    e_values, e_codes = chain_arguments(epilogue, sides, x)
    # The kernels take x, then the prologue and the epilogue as tuples (symm_device): the
    # epilogue's runtime part leads with its outputs and the norm's operands.
    outputs = (out, x if pre is None else pre, x if weight is None else weight,
               x if residual is None else residual, float(eps))
    head = (x, p_values, outputs + e_values)
    kwargs = dict(
        PROLOGUE=p_codes, EPILOGUE=e_codes + (norm, pre is not None), ITEM=layout.item,
        BLOCK=layout.block, WORLD_SIZE=buffer.world_size,
        WS_P2=world_size_pow2(buffer.world_size), ON_GPU=x.is_cuda, num_warps=layout.num_warps)
    return layout, head, kwargs
