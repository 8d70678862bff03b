"""Elementwise chains and row norms inside the symmetric-memory all-reduce kernels.

A chain is up to three ops, each an op code (constexpr), a scalar and a side-tensor pointer. It
is the same encoding for the prologue (applied to the local input as it is pushed into symmetric
memory) and for the epilogue (applied to the reduced value). Every op computes in fp32 and
rounds once to the tensor dtype, which is exactly what the ops' references (kernels/epilogue) do,
so a fused chain and the unfused graph agree to the last bit wherever the transcendental
functions agree. Each op's device code is in its spec; `apply_op`, `norm_operands` (the norm's
loads) and `apply_norm` are generated from the specs, one constexpr branch per op.

Unfused equivalent of an epilogue `relu, scale(s)` followed by add_rms_norm:
    y = all_reduce(x); y = relu(y); y = y * s
    out, residual = rms_norm(y + residual) * weight, y + residual
"""

from __future__ import annotations

import functools
import hashlib
import linecache
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.nt_runtime import interpreting
from infini_dist.kernels.symm_signal import world_size_pow2

MAX_CHAIN = 3
NONE = NO_NORM = tl.constexpr(0)  # (tl.constexpr so that kernels may read them)

# Op codes, derived from the specs (kernels/epilogue) in their fixed order, so every rank
# agrees: CODES[step name] for the chain steps, NORM_CODES[op name] for the norm slot.
_STEPS = [(spec, step) for spec in SPECS.values() for step in spec.symm_steps]
CODES = {step.name: code for code, (_, step) in enumerate(_STEPS, start=1)}
STEPS = {step.name: step for _, step in _STEPS}
_NORMS = [spec for spec in SPECS.values() if spec.symm_norm is not None]
NORM_CODES = {spec.name: code for code, spec in enumerate(_NORMS, start=1)}
# The norms that can also write their per-row rsqrt (the rms_rstd output).
RSTD_NORMS = frozenset(NORM_CODES[spec.name] for spec in _NORMS if spec.symm_norm.rstd)
# QUANT_CODES[op name]: the output quantization (finish_item's last step), NO_QUANT for none.
NO_QUANT = tl.constexpr(0)
_QUANTS = [spec for spec in SPECS.values() if spec.symm_quant is not None]
QUANT_CODES = {spec.name: code for code, spec in enumerate(_QUANTS, start=1)}
ROW_SCALE_QUANTS = frozenset(QUANT_CODES[spec.name] for spec in _QUANTS
                             if spec.symm_quant.row_scale)
# The norms whose output's row max a per-row quantizer can take from the norm (SymmNorm.factor).
PEAK_NORMS = frozenset(NORM_CODES[spec.name] for spec in _NORMS if spec.symm_norm.factor)
# Triton reads TRITON_INTERPRET when it decorates a kernel: this module's are made at import.
INTERPRETED = tl.constexpr(interpreting())
# Those reading their scale from a one-element tensor (the `scales_ptr` slot) at run time.
SCALE_OPERAND_QUANTS = frozenset(QUANT_CODES[spec.name] for spec in _QUANTS
                                 if spec.symm_quant.scale_operand)


@dataclass(frozen=True)
class ChainOp:
    code: int
    scalar: float = 0.0
    side: str | None = None  # name of the side tensor in the env


def encode_node(node, chain_value: str, side_kind=lambda name: "row",
                row_len: int | None = None) -> ChainOp | None:
    """The ChainOp for an elementwise node applied to `chain_value`, or None if we lack it.
    `side_kind(name)`: "row", "vector" or None (neither) for the node's other operand."""
    spec = SPECS.get(node.op_type)
    others = [n for n in node.inputs if n != chain_value]
    if spec is None or not spec.symm_steps or node.inputs.count(chain_value) != 1 \
            or len(others) > 1:
        return None  # e.g. mul(y, y): the chain value twice
    side = side_kind(others[0]) if others else None
    if others and side is None:
        return None
    if spec.symm_pick is not None:
        name = spec.symm_pick(node.inputs.index(chain_value), node.attr_dict, side)
    else:
        name = next((step.name for step in spec.symm_steps if step.side == side), None)
    step = STEPS.get(name)
    if step is None or step.side != side:
        return None
    scalar = 0.0
    if step.scalar is not None:
        scalar = node.attr(step.scalar, dict(spec.attrs).get(step.scalar))
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
            return None
    elif side == "vector":
        if row_len is None:
            return None
        scalar = row_len
    return ChainOp(CODES[name], float(scalar), others[0] if others else None)


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
def round_pairs_to(x, DTYPE: tl.constexpr):
    """`round_to` with the same bits, bfloat16 rounded two elements a conversion
    (cvt.rn.bf16x2.f32). Where the rounded value goes back to fp32 (the quantizer's input),
    Triton's cast converts one element at a time, and the conversion pipe takes 16 a clock on an
    SM: 0.14 µs for a 4096-wide row in one program, on the path after the poll (the static FP8
    output's whole cost at 1-16 tokens on 2 H100s, docs/notes_symm.md "Session 26")."""
    if INTERPRETED or DTYPE != tl.bfloat16:
        return round_to(x, DTYPE)
    # bf16 is fp32's upper half: element 0's rounded bits shift up, element 1's are masked
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
        "and.b32 $1, t, 0xffff0000; }", "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True,
        pack=2)


@triton.jit
def sigmoid_fp32(x):
    return 1.0 / (1.0 + tl.exp(-x))


_LOADS = {"row": "side_ptr + index",
          "vector": "side_ptr + index % tl.cast(scalar, tl.int64)"}  # scalar: the row length


@triton.jit
def _sum_and_max(sum_a, max_a, sum_b, max_b):
    return sum_a + sum_b, tl.maximum(max_a, max_b)


@triton.jit
def squares_and_peak(y, factor):
    """The row's sum of y^2 and max |factor| (keep_dims). On a GPU one reduction of the pair:
    one round of shuffles and barriers where two reductions make two. Interpreted, the sum is
    numpy's as in tl.sum (a tuple's reduction is a Python loop there)."""
    if INTERPRETED:
        squares = tl.sum(y * y, axis=-1, keep_dims=True)
        peak = tl.max(tl.abs(factor), axis=-1, keep_dims=True)
    else:
        squares, peak = tl.reduce((y * y, tl.abs(factor)), -1, _sum_and_max, keep_dims=True)
    return squares, peak


def dispatch_source() -> str:
    """`apply_op` (a chain step by op code), `norm_operands` (the norm slot's weight and bias,
    as loaded), `apply_norm` (the norm slot by norm code: the normalised row, its rsqrt and,
    where PEAK, the row's max |output| before rounding), `quant_operand` (the quantizer's
    scale: the scalar, or for a quantizer of SCALE_OPERAND_QUANTS its one-element tensor as
    loaded) and `apply_quant` (the output quantization by quant code, with that scale; PEAK:
    the row's max |y| is `peak`, not reduced again), with one constexpr branch per spec'd step,
    norm and quantizer."""
    lines = ["@triton.jit",
             "def apply_op(x, OP: tl.constexpr, scalar, side_ptr, index, mask, "
             "DTYPE: tl.constexpr):",
             "    if OP == 0:",
             "        y = x  # already rounded: rounding again below changes nothing"]
    for name, code in CODES.items():
        step = STEPS[name]
        lines.append(f"    elif OP == {code}:  # {name}")
        if step.side is not None:
            lines.append(f"        side = tl.load({_LOADS[step.side]}, mask=mask, "
                         f"other=0.0).to(tl.float32)")
        lines.append(f"        y = {step.expr}")
    lines += ["    return round_to(y, DTYPE)", "", "",
              "@triton.jit",
              "def norm_operands(column, mask, weight_ptr, bias_ptr, NORM: tl.constexpr):",
              "    weight = tl.load(weight_ptr + column, mask=mask, other=0.0)",
              "    bias = weight  # read by no norm without a bias role"]
    for spec in _NORMS:
        if "bias" in spec.symm_norm.roles:
            lines += [f"    if NORM == {NORM_CODES[spec.name]}:  # {spec.name}",
                      "        bias = tl.load(bias_ptr + column, mask=mask, other=0.0)"]
    lines += ["    return weight, bias", "", "",
              "@triton.jit",
              "def apply_norm(y, column, mask, weight, bias, eps, NORM: tl.constexpr, "
              "ROW_LEN: tl.constexpr, PEAK: tl.constexpr):",
              "    weight = weight.to(tl.float32)",
              "    bias = bias.to(tl.float32)",
              "    peak = eps  # read only where PEAK"]
    for i, spec in enumerate(_NORMS):
        norm = spec.symm_norm
        lines.append(f"    {'if' if i == 0 else 'elif'} NORM == {NORM_CODES[spec.name]}:"
                     f"  # {spec.name}")
        if norm.factor:  # its code is `y = (factor) * rstd` (rms_slot): written out here
            body = [f"factor = {norm.factor}",
                    "if PEAK:",
                    "    squares, peak = squares_and_peak(y, factor)",
                    "else:",
                    "    squares = tl.sum(y * y, axis=-1, keep_dims=True)",
                    f"rstd = {norm.rstd}",
                    "y = factor * rstd",
                    "peak = peak * rstd  # max |y| where PEAK: fp32 rounding is monotonic"]
        else:
            body = ["squares = tl.sum(y * y, axis=-1, keep_dims=True)"] if norm.rstd else []
            # A norm without an rsqrt returns y in its place: never stored (RSTD_NORMS).
            body += [f"rstd = {norm.rstd or 'y'}", *norm.code.splitlines()]
        lines += [f"        {line}" for line in body]
    lines += ["    return y, rstd, peak", "", "",
              "@triton.jit",
              "def quant_operand(scale, scales_ptr, QUANT: tl.constexpr):"]
    for spec in _QUANTS:
        if spec.symm_quant.scale_operand:
            lines += [f"    if QUANT == {QUANT_CODES[spec.name]}:  # {spec.name}",
                      "        scale = tl.load(scales_ptr).to(tl.float32)"]
    lines += ["    return scale", "", "",
              "@triton.jit",
              "def apply_quant(y, index, column, mask, QUANT: tl.constexpr, scale, scales_ptr, "
              "ROW_LEN: tl.constexpr, peak, PEAK: tl.constexpr):",
              "    q = y"]
    for spec in _QUANTS:
        lines.append(f"    if QUANT == {QUANT_CODES[spec.name]}:  # {spec.name}")
        if spec.symm_quant.row_scale:
            lines += ["        if PEAK:",
                      "            row_max = peak",
                      "        else:",
                      "            row_max = tl.max(tl.abs(y), axis=-1, keep_dims=True)"]
        lines += [f"        {line}" for line in spec.symm_quant.code.splitlines()]
        if spec.symm_quant.row_scale:  # one value per row: the row's first lane stores it
            lines.append("        tl.store(scales_ptr + index // ROW_LEN, row_scale, "
                         "mask=mask & (column == 0))")
    lines.append("    return q")
    return "\n".join(lines) + "\n"


def _dispatch():
    source = dispatch_source()
    filename = f"<infini_dist symm dispatch {hashlib.sha256(source.encode()).hexdigest()[:16]}>"
    # Triton reads a jit function's source back with inspect.getsource.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    # __name__ gives the generated functions a __module__: Triton's compiler (not its interpreter)
    # reads it for every global a kernel names, and fails on None.
    namespace = {"__name__": __name__, "triton": triton, "tl": tl, "round_to": round_to,
                 "sigmoid_fp32": sigmoid_fp32, "squares_and_peak": squares_and_peak}
    exec(compile(source, filename, "exec"), namespace)
    return (namespace["apply_op"], namespace["norm_operands"], namespace["apply_norm"],
            namespace["quant_operand"], namespace["apply_quant"])


apply_op, norm_operands, apply_norm, quant_operand, apply_quant = _dispatch()


@triton.jit
def apply_chain(x, index, mask, OP0: tl.constexpr, scalar0, side0, OP1: tl.constexpr, scalar1,
                side1, OP2: tl.constexpr, scalar2, side2, DTYPE: tl.constexpr):
    x = apply_op(x, OP0, scalar0, side0, index, mask, DTYPE)
    x = apply_op(x, OP1, scalar1, side1, index, mask, DTYPE)
    return apply_op(x, OP2, scalar2, side2, index, mask, DTYPE)


@triton.jit
def finish_item(y, index, column, mask, out_ptr, pre_ptr, rstd_ptr, reduced_ptr, residual,
                weight, bias, eps, E_OP0: tl.constexpr, e_scalar0, e_side0,
                E_OP1: tl.constexpr, e_scalar1, e_side1, E_OP2: tl.constexpr, e_scalar2, e_side2,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, WRITE_PRE: tl.constexpr,
                WRITE_RSTD: tl.constexpr, WRITE_REDUCED: tl.constexpr, ROW_LEN: tl.constexpr,
                QUANT: tl.constexpr, quant_scale, scales_ptr, PEAK: tl.constexpr):
    """Epilogue of one item (a row when NORM != NO_NORM) from its reduced value `y` (fp32, already
    rounded to the input dtype like the all_reduce output), then its stores. `residual`,
    `weight`, `bias` and `quant_scale` are values, loaded already (symm_device.epilogue_operands:
    a Lamport kernel loads them before its poll). RESIDUAL: the residual is added in fp32 before the
    norm, and that sum is the value `pre` stores.
    WRITE_RSTD: the norm's fp32 rsqrt per row, at `rstd_ptr` + row (training saves it for
    backward). WRITE_REDUCED: `y` itself too (a training graph may read the all_reduce's value
    beside the norm). QUANT: the value is quantized last (`out` holds the quantizer's dtype,
    e.g. fp8, while `pre` keeps the input dtype; a per-row scale goes to `scales_ptr`). `y` may
    also be a [group, row] tile of several items; `column` then is [1, row]. PEAK (a per-row
    quantizer after a norm of PEAK_NORMS): the quantizer's row max comes from the norm's
    reduction; the same bits as its own pass over the rounded output, one reduction fewer."""
    # pre_ptr is x itself when `pre` is not stored: the input dtype, which `out` lacks when
    # quantized, and every unfused op before the quantizer rounds to.
    dtype = pre_ptr.dtype.element_ty
    peak = eps
    if WRITE_REDUCED:
        tl.store(reduced_ptr + index, y.to(dtype), mask=mask)
    y = apply_chain(y, index, mask, E_OP0, e_scalar0, e_side0, E_OP1, e_scalar1, e_side1,
                    E_OP2, e_scalar2, e_side2, dtype)
    if NORM != NO_NORM:
        if RESIDUAL:
            y = y + residual.to(tl.float32)
        if WRITE_PRE:
            tl.store(pre_ptr + index, y.to(dtype), mask=mask)
        y, rstd, peak = apply_norm(tl.where(mask, y, 0.0), column, mask, weight, bias, eps,
                                   NORM, ROW_LEN, PEAK)
        if WRITE_RSTD:  # one value per row (an item is a row), stored by its first element
            tl.store(rstd_ptr + index // ROW_LEN, tl.broadcast_to(rstd, index.shape),
                     mask=mask & (column == 0))
    if QUANT != NO_QUANT:
        # The max of the rounded outputs is the rounded max: rounding is monotonic.
        y = apply_quant(tl.where(mask, round_pairs_to(y, dtype), 0.0), index, column, mask, QUANT,
                        quant_scale, scales_ptr, ROW_LEN, round_to(peak, dtype), PEAK)
    tl.store(out_ptr + index, y.to(out_ptr.dtype.element_ty), mask=mask)


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
                    weight=None, bias=None, residual=None, eps=1e-6, pre=None, rstd=None,
                    reduced=None, row_len=None, quant=0, quant_scale=0.0, scales=None,
                    fold_row_max=True):
    """What every fused symmetric-memory launch on `buffer` (symm_buffers.SymmBuffer) shares,
    as (layout, leading args, kwargs). `prologue` / `epilogue` are ChainOps whose side tensors
    are looked up in `sides`; `norm` is a norm code, with `weight`, `bias` (layer_norm) and
    `residual` (added before the norm) over rows of `row_len`. The kernel writes `out` and, each
    if given, `pre` (the value the norm normalises, i.e. the new residual), `rstd` (fp32, one
    per row: that value's rsqrt(mean(pre^2) + eps), for a norm of RSTD_NORMS) and `reduced`
    (the all_reduce's value, before the epilogue); x stands in for the pointers a launch does
    not use. `quant`: a quant code, quantizing `out` last (`quant_scale`: its scalar, or for a
    quantizer of SCALE_OPERAND_QUANTS the one-element tensor it reads at run time; `scales`: the
    rows x 1 fp32 scales a per-row quantizer writes). The kernels have one slot for both
    tensors, `scales_ptr`: no quantizer writes per-row scales and reads a scale tensor.
    `fold_row_max` (SymmTuning.fold_row_max): a per-row quantizer after a norm of PEAK_NORMS
    takes its row max from the norm's reduction (finish_item's PEAK).
    Reads of the tensors: x.numel(), x.element_size() and x.is_cuda only, so the launch can be
    bound once and reused with other tensors of the same shape (scheduler/backends/symm_launch.PreparedLaunch)."""
    if rstd is not None and norm not in RSTD_NORMS:
        raise ValueError(f"norm code {norm} has no rsqrt to write; those that do: "
                         f"{sorted(RSTD_NORMS)}")
    if (quant in ROW_SCALE_QUANTS) != (scales is not None) or (
            scales is not None and norm == NO_NORM.value):
        raise ValueError("a per-row quantizer writes `scales` and needs a norm (its layout "
                         "holds a whole row per item); others write none")
    scale_operand = isinstance(quant_scale, torch.Tensor)
    if (quant in SCALE_OPERAND_QUANTS) != scale_operand or (
            scale_operand and (quant_scale.numel() != 1 or quant_scale.device != x.device)):
        wanted = ("a one-element tensor on x's device" if quant in SCALE_OPERAND_QUANTS
                  else "a number")
        raise ValueError(f"quant code {quant} takes its scale as {wanted}")
    layout = launch_layout(x.numel(), row_len, norm, buffer.world_size)
    p_values, p_codes = chain_arguments(prologue, sides, x)
    e_values, e_codes = chain_arguments(epilogue, sides, x)
    # The kernels take x, then the prologue and the epilogue as tuples (symm_device): the
    # epilogue's runtime part leads with its outputs and the norm's operands.
    outputs = tuple(x if t is None else t
                    for t in (out, pre, rstd, reduced, weight, bias, residual)) + (float(eps),)
    slot = quant_scale if scale_operand else x if scales is None else scales
    quantize = (0.0 if scale_operand else float(quant_scale), slot)
    head = (x, p_values, outputs + e_values + quantize)
    writes = (pre is not None, rstd is not None, reduced is not None)
    peak = fold_row_max and quant in ROW_SCALE_QUANTS and norm in PEAK_NORMS
    kwargs = dict(
        PROLOGUE=p_codes,
        EPILOGUE=e_codes + (norm, residual is not None) + writes + (quant, peak),
        ITEM=layout.item, BLOCK=layout.block, WORLD_SIZE=buffer.world_size,
        WS_P2=world_size_pow2(buffer.world_size), ON_GPU=x.is_cuda, num_warps=layout.num_warps)
    return layout, head, kwargs
