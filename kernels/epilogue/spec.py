"""What one epilogue op is, in one place: `OpSpec`. Every table the engine, the compile pass and
the two chain kernels keep per op is derived from the specs (`infini_dist.kernels.epilogue`).

Pure Python and torch: the engine imports the specs without Triton or ninetoothed. The kernel
code of an op is therefore source text, spliced into the one generated kernel of each chain:

- `nt_code(step, args, results)`: statements of the ninetoothed chain (elementwise_chain), in
  fp32 locals; `nt_helpers` names the helpers of kernels/nt_device.py the statements call. A rowwise
  op's statements see whole rows (`in_row` masks the lanes past the row end, `num_cols` is the
  row length); a result listed in `per_row_outputs` is a (rows, 1) local, stored as such.
- `symm_steps`: the op as a step of the symmetric-memory chain (symm_chain.apply_op). Each is
  an expression of `x` (the fp32 chain value), `scalar` and `side` (the fp32 side operand).
- `symm_norm`: the op in the norm slot of the symmetric-memory kernels (symm_chain.finish_item):
  statements turning `y` (a masked fp32 row, zero past its end) into the normalised `y`, with
  `mask`, `weight`, `bias` (fp32 rows), `eps` and `ROW_LEN` in scope; for an RMSNorm also the
  expression of its per-row rsqrt, which the statements read as `rstd` and the kernels can write
  as the rms_rstd output (training keeps it for backward).
- `symm_quant`: the op as the output quantization of the symmetric-memory kernels, the last step
  of symm_chain.finish_item (after the chain or the norm): `out` is stored in the op's
  `out_dtype` while `pre` (the residual sum) keeps the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# Sentinels of the FX spellings: exact in fp32 (a traced eps is often rounded to fp32) and unlike
# any constant of a decomposition, so a template position holding one is an attribute slot.
EPS = 2.0 ** -15 + 2.0 ** -25
SCALE = 0.3125 + 2.0 ** -12


@dataclass(frozen=True)
class Spelling:
    """One plain-torch spelling of the op that the compile pass matches (inputs in the op's
    order); compile/fx_patterns traces it through Inductor's decompositions."""
    name: str
    fn: Callable
    chain_inputs: tuple[int, ...] = (0,)  # inputs that may carry the site's value
    attrs: tuple[tuple[str, Any], ...] = ()  # fixed attributes
    captures: tuple[tuple[str, float], ...] = ()  # attribute <- sentinel in the trace
    # The op's attributes from the captured values, where a spelling states one otherwise (a
    # floor before a division rather than after it); None from it: not this op after all.
    attrs_of: Callable[[dict], dict | None] | None = None
    commutative: bool = False
    # An interior value the graph may also read (training saves the norm's rsqrt), as the op
    # computing it from input 0 and the aten op yielding it.
    exposable: tuple[str, Any] | None = None


@dataclass(frozen=True)
class SymmStep:
    """One step of the symmetric-memory chain. `side`: None, "row" (a tensor of the chain's
    shape) or "vector" (1-D over the last dim; the host passes the row length as `scalar`);
    `scalar`: the attribute carried in `scalar` (None: 0.0, or the row length)."""
    name: str
    expr: str
    side: str | None = None
    scalar: str | None = None


@dataclass(frozen=True)
class SymmNorm:
    """The op in the norm slot. `roles` names each operand: "value" (the chain value), "weight",
    "bias", "residual" (added in fp32 before the norm; value and residual commute). `rstd`: an
    expression of `squares` (the row's sum of y^2, keep_dims) for rsqrt(mean(y^2) + eps) per
    row, bound to `rstd` before `code` runs, so the rms_rstd output is the very value the norm
    multiplied by; None where the norm has no such factor (LayerNorm's is of the centred row:
    rms_rstd is not it). `factor`: for a norm whose `code` is `y = (factor) * rstd`, that
    expression of `y` and the operands (`rms_slot` writes both). A per-row quantizer then takes
    the row's max |output| as max|factor| * rstd, reduced together with `squares`
    (symm_chain.apply_norm's PEAK)."""
    code: str
    roles: tuple[str, ...]
    rstd: str | None = None
    factor: str | None = None


@dataclass(frozen=True)
class SymmQuant:
    """The op as the symmetric-memory kernels' output quantization. `code`: statements turning
    `y` (fp32, rounded to the input dtype as the op's unfused input is; zero where `mask` is
    off) into `q`, stored as `out` in the spec's `out_dtype`, with `scale` in scope: the float
    attribute named `scalar` (None: 0.0), or with `scale_operand`, the op's one-element tensor
    operand (its `scalars`) loaded in fp32 at run time, so a checkpoint's scale may change
    between calls and CUDA-graph replays. `row_scale`: the code also sets `row_scale`, one fp32
    value per row ([rows, 1], so only after a norm), stored as the op's second output, from
    `row_max`: the row's max |y|, in scope ([rows, 1]; symm_chain.apply_quant)."""
    code: str
    scalar: str | None = None
    row_scale: bool = False
    scale_operand: bool = False


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: str  # "elementwise" or "rowwise" (a row reduction: needs the whole reduced row)
    arity: int
    reference: Callable  # fp32 compute, one rounding
    native: Callable | None = None  # how user code runs it (None: the reference)
    num_outputs: int = 1
    attrs: tuple[tuple[str, Any], ...] = ()  # (name, default)
    choices: tuple[tuple[str, tuple], ...] = ()  # attrs taking one of some strings, not numbers
    vectors: tuple[int, ...] = ()  # operands that are 1-D over the last dim (weight, bias)
    # Operands that are one-element float tensors of any float dtype (a checkpoint's FP8 scale),
    # read at run time rather than baked in as an attribute.
    scalars: tuple[int, ...] = ()
    out_dtype: torch.dtype | None = None  # None: the input's (promoted) dtype
    # Results (by index) holding one fp32 value per row, shape [..., 1] (a reduction over the
    # whole row, such as per-token scales): `out_dtype` is not theirs; they are only stored.
    per_row_outputs: tuple[int, ...] = ()
    spellings: tuple[Spelling, ...] = ()
    nt_code: Callable | None = None
    nt_helpers: tuple[str, ...] = ()  # functions of infini_dist.kernels.nt_device
    symm_steps: tuple[SymmStep, ...] = ()
    symm_pick: Callable | None = None  # (position, attrs, side kind) -> step name | None
    symm_norm: SymmNorm | None = None
    symm_quant: SymmQuant | None = None
    doc: str = field(default="", compare=False)


def fp32(fn):
    """Float math in (at least) fp32, rounded once to the dtype torch would give; integer and
    bool math as torch does it (relu stays int, `int * 2.5` is float, silu on ints raises)."""
    def wrapped(*tensors, **attrs):
        out_dtype = torch.result_type(*tensors) if len(tensors) == 2 else tensors[0].dtype
        if not out_dtype.is_floating_point:
            return fn(*tensors, **attrs)
        compute = torch.promote_types(out_dtype, torch.float32)
        return fn(*(t.to(compute) for t in tensors), **attrs).to(out_dtype)
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def check_norm_input(name: str, x) -> None:
    """torch's errors for integer and 0-d inputs, the same on every path."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} needs a floating-point input, got {x.dtype} (torch: "
                        f'"{name}" not implemented for {x.dtype})')
    if x.dim() == 0:
        raise RuntimeError(f"{name}: Expected normalized_shape to be at least 1-dimensional, "
                           "but the input is 0-d")


def compute_dtype(x) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def same_dtype(x, *vectors):
    """A norm's weight (and bias) in x's dtype: native torch norms want one dtype."""
    return tuple(v if v.dtype == x.dtype else v.to(x.dtype) for v in vectors)


def elementwise(name: str, fn: Callable, arity: int, **kw) -> OpSpec:
    """An elementwise op whose reference is `fn` in fp32 and whose native is `fn` itself."""
    return OpSpec(name, "elementwise", arity, fp32(fn), native=fn, **kw)


def float_literal(op: str, name: str, value) -> str:
    """A numeric attribute as the exact literal the generated kernels use."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{op}: attribute {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or (name == "eps" and value < 0):
        raise ValueError(f"{op}: attribute {name}={value!r} is not supported")
    return repr(value)  # exact: repr round-trips a float
