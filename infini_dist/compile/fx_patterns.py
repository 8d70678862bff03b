"""The post-grad forms of the ops a site may absorb, and a matcher for them.

Inductor decomposes silu, gelu and rms_norm before post-grad passes run (silu becomes
x / (1 + exp(-x)), with fp32 up- and down-casts around it for half types), and the exact form
depends on the torch version, the dtype and the tensor rank. So the forms are not spelled out by
hand: each IR op's spellings are written once in plain torch, in its spec (kernels/epilogue;
`FORMS` lists them), and traced through Inductor's own decomposition table, the route
Inductor's pattern matcher takes for its own patterns. The traced graph is the pattern. Scalars
that become IR attributes (eps, scale) are traced with a sentinel value and captured from the
matched node: a constant, or a 0-dim CPU tensor the graph reads there (`RunTimeScalar`).

Matching is rooted at a graph node (the pattern's output) and walks arguments backwards, trying
both operand orders of add and mul.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from infini_dist.kernels.epilogue import SPECS

aten = torch.ops.aten
log = logging.getLogger("infini_dist")


@dataclass(frozen=True)
class Form:
    """One torch spelling of an IR op. Inputs are in the IR op's order."""
    name: str
    op_type: str
    fn: Callable
    arity: int
    chain_inputs: tuple[int, ...] = (0,)  # inputs that may carry the site's value
    attrs: tuple[tuple[str, Any], ...] = ()  # fixed IR attributes
    captures: tuple[tuple[str, float], ...] = ()  # IR attribute <- sentinel in the trace
    commutative: bool = False  # the IR op may take its inputs in either order
    # An interior value the graph may also read (training saves the norm's rsqrt for backward),
    # with the IR op that computes it from input 0 and the aten op that yields it.
    exposable: tuple[str, Any] | None = None
    vectors: tuple[int, ...] = ()  # inputs that are 1-D over the last dim (a norm's weight)
    out_dtype: torch.dtype | None = None  # the result's dtype, where not input 0's
    scalars: tuple[int, ...] = ()  # inputs that are one-element tensors (an FP8 scale)
    attrs_of: Callable | None = None  # as spec.Spelling's
    per_row_outputs: tuple[int, ...] = ()  # results of one fp32 value per row (spec.OpSpec's)


# Every spelling of every op spec (kernels/epilogue), in spec order.
FORMS = tuple(
    Form(spelling.name, spec.name, spelling.fn, spec.arity, spelling.chain_inputs, spelling.attrs,
         spelling.captures, spelling.commutative, spelling.exposable, spec.vectors,
         spec.out_dtype, spec.scalars, spelling.attrs_of, spec.per_row_outputs)
    for spec in SPECS.values() for spelling in spec.spellings)

_COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


@dataclass(frozen=True)
class Template:
    form: Form
    placeholders: tuple[fx.Node, ...]
    root: fx.Node
    size: int  # call_function nodes
    exposable: fx.Node | None  # the interior node yielding the form's exposable value
    # The op's further outputs (a spelling returning several values: per-token quantization's
    # scales), interior nodes of the pattern.
    further: tuple[fx.Node, ...] = ()


def _example_inputs(form: Form, dtype, ndim: int, device) -> list[torch.Tensor]:
    shape = (2,) * (ndim - 1) + (8,)
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for index in range(form.arity):
        size = shape[-1:] if index in form.vectors else () if index in form.scalars else shape
        t = torch.randn(size, generator=gen, dtype=torch.float32)
        tensors.append(t.to(device=device, dtype=dtype))
    return tensors


def _functional(target):
    """aten.add_.Scalar -> aten.add.Scalar. Decompositions traced outside AOTAutograd may use
    in-place ops on their own temporaries; the post-grad graph is functionalized."""
    if not isinstance(target, torch._ops.OpOverload):
        return target
    namespace, name = target._schema.name.split("::")
    if not name.endswith("_"):
        return target
    packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
    overload = target._overloadname
    return getattr(packet, overload, target) if packet is not None else target


def _trace(form: Form, dtype, ndim: int, device) -> Template | None:
    from torch._inductor.pattern_matcher import fwd_only
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        gm = fwd_only(form.fn, _example_inputs(form, dtype, ndim, device))
    for node in gm.graph.nodes:
        node.target = _functional(node.target)
    placeholders = tuple(n for n in gm.graph.nodes if n.op == "placeholder")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0]
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    root, further = results[0], results[1:]
    if (not isinstance(root, fx.Node) or root.op != "call_function"
            or len(placeholders) != form.arity
            or not all(isinstance(n, fx.Node) and n.op == "call_function" for n in further)):
        return None  # e.g. relu of an int tensor: nothing to match
    size = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    exposable = None
    if form.exposable is not None:
        found = [n for n in gm.graph.nodes if n.target == form.exposable[1]]
        exposable = found[0] if len(found) == 1 else None
    return Template(form, placeholders, root, size, exposable, further)


@functools.lru_cache(maxsize=None)
def templates(dtype: torch.dtype, ndim: int, device_type: str) -> tuple[Template, ...]:
    """Every form traced for a site value of this dtype and rank, largest first."""
    if not dtype.is_floating_point or ndim < 1:
        return ()  # the IR's elementwise ops and norms are for floating-point values
    device = torch.device(device_type)
    if device_type == "cuda" and not torch.cuda.is_available():
        # Fake CUDA values on a machine without CUDA (the CPU tests of GPU graphs): the forms'
        # structure does not depend on the device, and real CUDA tensors cannot be made here.
        device = torch.device("meta")
    traced = []
    for form in FORMS:
        try:
            template = _trace(form, dtype, ndim, device)
        except Exception as error:  # noqa: BLE001 - a form this torch cannot trace is not matched
            log.debug("infini_dist: cannot trace %s for %s/%dd/%s: %s", form.name, dtype, ndim,
                      device_type, error)
            continue
        if template is not None:
            traced.append(template)
    return tuple(sorted(traced, key=lambda t: -t.size))


@dataclass(frozen=True)
class RunTimeScalar:
    """An attribute slot that the graph fills with a value rather than a constant: a 0-dim
    floating-point CPU tensor. Under `torch.compile(dynamic=True)` Dynamo turns a Python float
    it reads (HF's `self.variance_epsilon`, a module's `self.scale`) into such a graph input,
    and the norm's `+ eps` becomes `+ convert_element_type(arg, float32)`. The site reads the
    value each time it runs (compile/runtime_op.py); reading a CPU tensor needs no device
    sync."""
    node: fx.Node


def _run_time_source(value: fx.Node) -> fx.Node:
    """The value before Dynamo's up-cast to fp32 (or fp64): the Python float itself, as a
    constant would have been captured, so a site's text is the same under dynamic=True as
    without it (and so are its decisions). Our kernels compute with an attribute in fp32 as the
    cast did."""
    if (value.target is torch.ops.prims.convert_element_type.default
            and value.args[1] in (torch.float32, torch.float64)
            and is_run_time_scalar(value.args[0])):
        return value.args[0]
    return value


def is_run_time_scalar(value: Any) -> bool:
    """Whether `value` is a graph value that an attribute slot may read at run time."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point
            and val.device.type == "cpu")


# ---- matching ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Match:
    template: Template
    inputs: tuple[fx.Node, ...]  # graph node per template placeholder (IR input order)
    nodes: frozenset  # graph nodes the pattern covers
    root: fx.Node
    attrs: dict
    exposed: fx.Node | None = None  # the template's exposable node, where read outside
    further: tuple = ()  # graph node per further output of the template (None: not read)

    @property
    def form(self) -> Form:
        return self.template.form

    @property
    def reads_run_time_scalars(self) -> bool:
        return any(isinstance(v, RunTimeScalar) for v in self.attrs.values())


def _same_constant(pattern: Any, value: Any) -> bool:
    """Equal constants. An int and a float of one value are the same number to the float ops
    the forms spell (448 and finfo's 448.0 in a clamp); a bool is no number here."""
    numbers = (int, float)
    if isinstance(pattern, bool) or isinstance(value, bool):
        return type(pattern) is type(value) and pattern == value
    if isinstance(pattern, numbers) or isinstance(value, numbers):
        return isinstance(pattern, numbers) and isinstance(value, numbers) and pattern == value
    return pattern == value


def _match_arg(pattern: Any, value: Any, state: dict, captures: dict) -> dict | None:
    if isinstance(pattern, fx.Node):
        return _match_node(pattern, value, state, captures)
    if isinstance(pattern, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(pattern) != len(value):
            return None
        for p, v in zip(pattern, value):
            state = _match_arg(p, v, state, captures)
            if state is None:
                return None
        return state
    if isinstance(pattern, float):
        # A sentinel, possibly rounded to fp32 on the way: an attribute slot.
        name = next((n for s, n in captures.items() if math.isclose(pattern, s, rel_tol=1e-6)),
                    None)
        if name is not None:
            if isinstance(value, fx.Node):
                if not is_run_time_scalar(value):
                    return None
                value = RunTimeScalar(_run_time_source(value))
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
            if state.get(("attr", name), value) != value:
                return None
            return {**state, ("attr", name): value}
    return state if _same_constant(pattern, value) else None


def _match_node(pattern: fx.Node, value: Any, state: dict, captures: dict) -> dict | None:
    if not isinstance(value, fx.Node):
        return None
    if pattern in state:
        return state if state[pattern] is value else None
    if pattern.op == "placeholder":
        return {**state, pattern: value}
    if value.op != "call_function" or value.target != pattern.target:
        return None
    if any(v is value for k, v in state.items()
           if isinstance(k, fx.Node) and k.op != "placeholder"):
        return None  # two pattern nodes cannot share one graph node
    state = {**state, pattern: value}
    orders = [pattern.args]
    if pattern.target in _COMMUTATIVE and len(pattern.args) == 2:
        orders.append((pattern.args[1], pattern.args[0]))
    for args in orders:
        if len(args) != len(value.args) or set(pattern.kwargs) != set(value.kwargs):
            continue
        result = _match_arg(tuple(args), tuple(value.args), state, captures)
        if result is not None:
            result = _match_arg(tuple(pattern.kwargs.values()),
                                tuple(value.kwargs[k] for k in pattern.kwargs), result, captures)
        if result is not None:
            return result
    return None


def match_at(template: Template, root: fx.Node) -> Match | None:
    """The template matched with its output at `root`, its interior private to it."""
    if root.op != "call_function" or root.target != template.root.target:
        return None
    captures = {sentinel: name for name, sentinel in template.form.captures}
    state = _match_node(template.root, root, {}, captures)
    if state is None:
        return None
    inputs = tuple(state.get(p) for p in template.placeholders)
    if any(n is None for n in inputs):
        return None
    nodes = frozenset(v for k, v in state.items()
                      if isinstance(k, fx.Node) and k.op != "placeholder")
    if any(n in nodes for n in inputs):
        return None
    exposable = state.get(template.exposable) if template.exposable is not None else None
    further = tuple(state.get(n) for n in template.further)
    if any(n is None or n is root for n in further):
        return None
    exposed = None
    for node in nodes:  # values inside the pattern may not be read from outside it
        if node is not root and node not in further and any(u not in nodes for u in node.users):
            if node is not exposable:
                return None
            exposed = node
    attrs = dict(template.form.attrs)
    captured = {}
    for name, _ in template.form.captures:
        if ("attr", name) not in state:
            return None
        value = state[("attr", name)]
        captured[name] = value if isinstance(value, RunTimeScalar) else float(value)
    if template.form.attrs_of is not None:
        if any(isinstance(v, RunTimeScalar) for v in captured.values()):
            return None  # attrs_of computes on the captured values: constants only
        captured = template.form.attrs_of(captured)
        if captured is None:
            return None
    attrs.update(captured)
    further = tuple(n if any(u not in nodes for u in n.users) else None for n in further)
    return Match(template, inputs, nodes, root, attrs, exposed, further)
