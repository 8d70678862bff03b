"""The op registry: per op a torch reference and a native implementation, and the rule table of
what may fuse where. The built-in epilogue ops come from their specs (kernels/epilogue).

References compute in fp32 and round once to the input dtype, the same contract our fused kernels
keep: they give the expected outputs every choice is checked against, and are never timed.
Native implementations are the ops as the user's own torch code runs them, in the input dtype:
the `native` choice every fused one has to beat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from infini_dist.kernels.epilogue import SPECS
from infini_dist.scheduler import data_plane
from infini_dist.scheduler.store import STORE

# kind -> where such an op may fuse around an anchor
FUSION_RULES: dict[str, frozenset[str]] = {
    # gather_prologue: before an all_gather, on the rank's own rows, which it holds whole
    "elementwise": frozenset({"prologue", "epilogue", "gather_prologue"}),
    "rowwise": frozenset({"epilogue", "gather_prologue"}),  # norms need the whole reduced row
    # matmul_prologue: the head of an all_reduce's prologue, the GEMM whose partial products
    # the reduction sums (a row-parallel projection)
    "matmul": frozenset({"matmul_prologue"}),
    # beside: independent work a site runs while its collective is in flight (fusion type
    # "overlap"): a weight-gradient GEMM beside the input gradient's all_reduce
    "beside": frozenset({"beside"}),
    "collective": frozenset(),
    "custom": frozenset(),
    "opaque": frozenset(),
}


@dataclass(frozen=True)
class RegisteredOp:
    name: str
    fn: Callable
    kind: str = "opaque"
    num_outputs: int = 1
    num_inputs: int | None = None
    outputs_per_input: bool = False  # all_reduce: one output per (coalesced) input
    implementations: dict[str, Callable] = field(default_factory=dict, compare=False, hash=False)
    native: Callable | None = field(default=None, hash=False)  # None: fn
    # A collective's outputs, empty, from its (fake or meta) inputs and attrs: what it returns
    # without talking to anyone (shape inference; None: contiguous tensors like its inputs).
    fake: Callable | None = field(default=None, hash=False)

    @property
    def is_anchor(self) -> bool:
        return self.kind == "collective" or (self.kind == "custom" and bool(self.implementations))


_REGISTRY: dict[str, RegisteredOp] = {}
_BUILTINS: frozenset[str] = frozenset()  # set once the built-in ops below are registered
_generation = 0


def generation() -> int:
    """Bumped whenever an op's definition changes: part of the key of everything built from
    the registry (executors, routes), so nothing keeps running a replaced definition."""
    return _generation


def register_op(name: str, fn: Callable, *, kind: str = "opaque", num_outputs: int = 1,
                num_inputs: int | None = None,
                implementations: dict[str, Callable] | None = None,
                native: Callable | None = None, replace: bool = False) -> RegisteredOp:
    """Register an op. `fn(*tensors, **attrs)` is its reference; `native` (same signature) is how
    the user's own code computes it, if that differs from `fn`.

    Give `implementations` ({name: fn}) to make it a deferred-choice site: each implementation is
    a choice, and so is each implementation with its epilogue chain fused after it.
    `kind` is 'elementwise' or 'rowwise' to let the op fuse into collectives' chains.
    Registering a user op's name again replaces it, implementations and all (a notebook cell
    run twice, a new scheduler); a built-in op is replaced only with replace=True.
    """
    global _generation
    if not isinstance(name, str) or not name:
        raise TypeError("op name must be a non-empty string")
    if not callable(fn):
        raise TypeError(f"op {name!r}: fn must be callable")
    if implementations:
        kind = "custom"
        for impl_name, impl in implementations.items():
            if not callable(impl):
                raise TypeError(f"op {name!r}: implementation {impl_name!r} is not callable")
    if native is not None and not callable(native):
        raise TypeError(f"op {name!r}: native must be callable")
    if kind not in FUSION_RULES:
        raise ValueError(f"op {name!r}: kind must be one of {sorted(FUSION_RULES)}, got {kind!r}")
    spec = RegisteredOp(name, fn, kind, num_outputs, num_inputs, False, dict(implementations or {}),
                  native)
    existing = _REGISTRY.get(name)
    if existing is not None:
        if existing == spec and existing.implementations == spec.implementations:
            return existing
        if name in _BUILTINS and not replace:
            raise ValueError(f"op {name!r} is a built-in op; pass replace=True to override it")
    _REGISTRY[name] = spec
    _generation += 1
    STORE.forget_launches()  # a record may launch the replaced definition
    return spec


def get_op(name: str) -> RegisteredOp:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(_REGISTRY))}. "
                         f"Register it with register_op().") from None


def registered_ops() -> list[str]:
    return sorted(_REGISTRY)


def attr_choices(op_type: str, attr: str) -> tuple:
    """The strings a built-in op's attribute may take (gelu's `approximate`), else ()."""
    spec = SPECS.get(op_type)
    return dict(spec.choices).get(attr, ()) if spec is not None else ()


def may_fuse(op_type: str, position: str) -> bool:
    spec = _REGISTRY.get(op_type)
    if spec is None or position not in FUSION_RULES[spec.kind]:
        return False
    # A quantizing op (an out_dtype such as fp8) ends a chain: its value is stored, never reduced
    # (no backend sums fp8), so it is no prologue of a reduction. Gathered, it is only copied.
    epilogue = SPECS.get(op_type)
    return position != "prologue" or epilogue is None or epilogue.out_dtype is None


# Where each anchor's prologue may come from (a reduction sums partials: elementwise only).
PROLOGUE_POSITION = {"all_reduce": "prologue", "reduce_scatter": "prologue",
                     "all_gather": "gather_prologue"}
# The anchors whose prologue chain may start with a matmul ("matmul_prologue").
MATMUL_ANCHORS = frozenset({"all_reduce"})


def run_node(op_type: str, tensors: list, attrs: dict, group=None, native: bool = False) -> tuple:
    """One node through its reference, or through its native implementation."""
    spec = get_op(op_type)
    fn = spec.native or spec.fn if native else spec.fn
    if spec.kind == "collective":
        result = fn(*tensors, group=group, **attrs)
    else:
        result = fn(*tensors, **attrs)
    return result if isinstance(result, tuple) else (result,)


def all_reduce(*tensors, group=None, op: str = "sum", group_name: str | None = None):
    """Sum each tensor over the group. Several inputs form one coalesced collective.

    `group_name` (an attr set by the compile pass) only names the group; the engine resolves it
    into `group` before calling this."""
    if op != "sum":
        raise ValueError(f"all_reduce supports op='sum' only, got {op!r}")
    outs = []
    for t in tensors:
        out = t.clone(memory_format=torch.contiguous_format)
        data_plane.all_reduce(out, group)
        outs.append(out)
    return tuple(outs)


def _group_size(group, group_size: int, op: str) -> None:
    import torch.distributed as dist
    actual = dist.get_world_size(group)
    if actual != group_size:
        raise ValueError(f"{op}: the graph was traced for a group of {group_size} ranks, but the "
                         f"group has {actual}")


def _chunks(tensor: torch.Tensor, group_size: int, op: str) -> int:
    if tensor.dim() == 0 or tensor.shape[0] % group_size:
        raise ValueError(f"{op}: dim 0 of a {tuple(tensor.shape)} tensor does not split into "
                         f"{group_size} equal chunks")
    return tensor.shape[0] // group_size


def reduce_scatter(tensor, group=None, op: str = "sum", group_size: int = 1,
                   group_name: str | None = None):
    """This rank's chunk along dim 0 of the tensor summed over the group (the group's ranks in
    order), as torch's functional reduce_scatter_tensor."""
    if op != "sum":
        raise ValueError(f"reduce_scatter supports op='sum' only, got {op!r}")
    _group_size(group, group_size, "reduce_scatter")
    out = _reduce_scatter_fake(tensor, group_size=group_size)
    data_plane.reduce_scatter(out, tensor.contiguous(), group)
    return out


def _reduce_scatter_fake(tensor, group_size: int = 1, **_):
    rows = _chunks(tensor, group_size, "reduce_scatter")
    return torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                       device=tensor.device)


def all_gather(tensor, group=None, group_size: int = 1, group_name: str | None = None):
    """Every rank's tensor, stacked along dim 0 in rank order (all_gather_into_tensor)."""
    _group_size(group, group_size, "all_gather")
    out = _all_gather_fake(tensor, group_size=group_size)
    data_plane.all_gather(out, tensor.contiguous(), group)
    return out


def _all_gather_fake(tensor, group_size: int = 1, **_):
    if tensor.dim() == 0:
        raise ValueError("all_gather: a 0-d tensor has no dim 0 to gather along")
    return torch.empty((tensor.shape[0] * group_size,) + tuple(tensor.shape[1:]),
                       dtype=tensor.dtype, device=tensor.device)


def fake_outputs(op_type: str, tensors: list, attrs: dict) -> tuple:
    """A collective's outputs, empty: shapes and dtypes without communication."""
    spec = get_op(op_type)
    if spec.fake is None:
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)
    result = spec.fake(*tensors, **attrs)
    return result if isinstance(result, tuple) else (result,)


def _matmul_operands(x, w, bias, transpose_weight: bool):
    """(x as [rows, K], w as [K, N], output shape x.shape[:-1] + (N,)), checked."""
    if x.dim() < 1 or w.dim() != 2 or (bias is not None and bias.dim() != 1):
        raise ValueError(f"matmul: x [..., K], a 2-D weight and a 1-D bias, got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}"
                         + (f", {tuple(bias.shape)}" if bias is not None else ""))
    w = w.t() if transpose_weight else w
    if w.shape[0] != x.shape[-1] or (bias is not None and bias.shape[0] != w.shape[1]):
        raise ValueError(f"matmul: shapes {tuple(x.shape)} and {tuple(w.shape)} (as [K, N]) do "
                         f"not multiply" + (" with the bias" if bias is not None else ""))
    return x.reshape(-1, x.shape[-1]), w, tuple(x.shape[:-1]) + (w.shape[1],)


def matmul(x, w, bias=None, transpose_weight: bool = False):
    """x @ w (+ bias): w is [K, N], or [N, K] with `transpose_weight` (F.linear's layout).
    Reference: fp32 products and sums, the bias added in fp32, rounded once to x's dtype, as a
    GEMM with an fp32 accumulator (cuBLAS, our Triton GEMM) computes it."""
    rows, w, shape = _matmul_operands(x, w, bias, transpose_weight)
    out = rows.float() @ w.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(shape)


def matmul_native(x, w, bias=None, transpose_weight: bool = False):
    """The matmul as the compiled graph spells it: mm or addmm on the rows (aten, in x's dtype)."""
    rows, w, shape = _matmul_operands(x, w, bias, transpose_weight)
    out = torch.mm(rows, w) if bias is None else torch.addmm(bias, rows, w)
    return out.reshape(shape)


def _weight_gradient_operands(dy, x):
    if dy.dim() < 1 or x.dim() < 1 or dy.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"weight_gradient: dy [..., N] and x [..., K] with the same rows, got "
                         f"{tuple(dy.shape)} and {tuple(x.shape)}")
    return dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])


def weight_gradient(dy, x):
    """dy^T @ x over the rows: a linear's weight gradient, [N, K] (F.linear's weight layout).
    Reference: fp32 products and sums, rounded once to dy's dtype."""
    dy, x = _weight_gradient_operands(dy, x)
    return (dy.float().t() @ x.float()).to(dy.dtype)


def weight_gradient_native(dy, x):
    """As the backward graph spells it: mm(permute(dy), x), in dy's dtype."""
    dy, x = _weight_gradient_operands(dy, x)
    return torch.mm(dy.t(), x)


_REGISTRY["matmul"] = RegisteredOp("matmul", matmul, "matmul", native=matmul_native)
_REGISTRY["weight_gradient"] = RegisteredOp("weight_gradient", weight_gradient, "beside",
                                            num_inputs=2, native=weight_gradient_native)
_REGISTRY["all_reduce"] = RegisteredOp("all_reduce", all_reduce, "collective", outputs_per_input=True)
_REGISTRY["reduce_scatter"] = RegisteredOp("reduce_scatter", reduce_scatter, "collective",
                                     num_inputs=1, fake=_reduce_scatter_fake)
_REGISTRY["all_gather"] = RegisteredOp("all_gather", all_gather, "collective", num_inputs=1,
                                 fake=_all_gather_fake)
for _spec in SPECS.values():  # the epilogue ops, each defined once in kernels/epilogue
    register_op(_spec.name, _spec.reference, kind=_spec.kind, num_inputs=_spec.arity,
                num_outputs=_spec.num_outputs, native=_spec.native)
_BUILTINS = frozenset(_REGISTRY)

# How far a choice may sit from the fp32 reference. All sides round: the reference once per op,
# native torch at every intermediate too (and NCCL in bf16 once per reduction step), a fused
# kernel once at the end, so the check is on the relative L2 error, plus a per-element bound
# against the tensor's scale that still catches a wrong or unwritten row in a large tensor.
TOLERANCE = {  # dtype: (relative L2, max element error / max |reference|)
    torch.float64: (1e-9, 1e-8), torch.float32: (1e-5, 1e-4),
    torch.float16: (5e-3, 2e-2), torch.bfloat16: (1e-2, 5e-2),
    torch.float8_e4m3fn: (7e-2, 1.25e-1),  # 3 mantissa bits: one rounding is up to 6.25%
}


def close_enough(actual: torch.Tensor, expected: torch.Tensor, computed_in=None) -> bool:
    """`computed_in`: the least precise float dtype the value was computed from. An fp32 output
    of bf16 inputs (an RMSNorm's saved rsqrt, bf16 * an fp32 vector) carries bf16 rounding from
    every intermediate a choice keeps in bf16, so it gets bf16's tolerance."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    if not expected.dtype.is_floating_point:
        return torch.equal(actual, expected)
    if actual.numel() == 0:
        return True
    l2_tol, max_tol = TOLERANCE.get(expected.dtype, (1e-2, 5e-2))
    if computed_in is not None and computed_in.is_floating_point:
        looser = TOLERANCE.get(computed_in, (1e-2, 5e-2))
        l2_tol, max_tol = max(l2_tol, looser[0]), max(max_tol, looser[1])
    a, e = actual.double(), expected.double()
    # torch propagates NaN and inf: a choice must have them at the same places (NaN = NaN).
    nan = torch.isnan(e)
    if not torch.equal(torch.isnan(a), nan):
        return False
    finite = torch.isfinite(e)
    if not torch.equal(torch.isfinite(a), finite):
        return False
    infinite = ~finite & ~nan
    if not torch.equal(a[infinite], e[infinite]):  # the same infinities
        return False
    diff = (a[finite] - e[finite]).abs()
    scale = e[finite].abs()
    if diff.numel() == 0:
        return True
    tiny = torch.finfo(expected.dtype).tiny
    relative = diff.norm() <= l2_tol * scale.norm() + tiny
    bounded = diff.max() <= max_tol * scale.max() + tiny
    return bool(relative and bounded)
