"""The chain format: a straight-line program of elementwise (and row-norm) steps that one generated
kernel runs, read directly off engine nodes. Pure Python: `supports()` checks use it without
importing Triton.

Values live in numbered slots: the chain's input tensors first, then each step's results in order
(add_rms_norm has two: normed, sum). A step names its op, the slots it reads and its attributes as
Python literals (they are written into the generated kernel, so equal chains are equal values).
`outputs` are the slots the kernel stores. Inputs are "row" tensors (the chain's shape, or
broadcast to it) or "weight" tensors (a norm's 1-D weight or bias over the last dim).

    b = add(a, r); c = relu(b); d = scale(c, scale=0.5)          (engine nodes)
    chain_from_nodes(nodes, inputs=("a", "r"), outputs=("d",)) ==
    Chain(inputs=("row", "row"),
          steps=(Step("add", (0, 1)), Step("relu", (2,)), Step("scale", (3,), (("scale", "0.5"),))),
          outputs=(4,))

A chain with a row-norm step runs whole rows per tile; one without runs flat elementwise tiles.
A rowwise op may also give "per-row" results (one fp32 value per row, of shape [..., 1]: the
scales of a per-token quantization), which only a rowwise chain computes and which are only
stored, never read by a later step.
"""

from __future__ import annotations


import torch
from dataclasses import dataclass

from infini_dist.kernels.epilogue import SPECS
from infini_dist.kernels.epilogue.spec import float_literal

# Derived from the op specs (kernels/epilogue): the ops that have ninetoothed chain code.
_CHAIN_SPECS = {name: spec for name, spec in SPECS.items() if spec.nt_code is not None}
ELEMENTWISE_OPS = {n: s.arity for n, s in _CHAIN_SPECS.items() if s.kind == "elementwise"}
ROWWISE_OPS = {n: s.arity for n, s in _CHAIN_SPECS.items() if s.kind == "rowwise"}
NUM_RESULTS = {n: s.num_outputs for n, s in _CHAIN_SPECS.items() if s.num_outputs != 1}
VECTOR_OPERANDS = {n: frozenset(s.vectors) for n, s in _CHAIN_SPECS.items() if s.vectors}
DEFAULT_ATTRS = {n: dict(s.attrs) for n, s in _CHAIN_SPECS.items() if s.attrs}
PER_ROW_RESULTS = {n: frozenset(s.per_row_outputs) for n, s in _CHAIN_SPECS.items()
                   if s.per_row_outputs}
PER_ROW_DTYPE = torch.float32  # what a per-row result is stored as (spec.OpSpec.per_row_outputs)
if set(PER_ROW_RESULTS) - set(ROWWISE_OPS):  # a spec error: only rowwise tiles hold whole rows
    raise ValueError(f"ops {sorted(set(PER_ROW_RESULTS) - set(ROWWISE_OPS))} give per-row "
                     "results but are not rowwise")
GELU_APPROXIMATIONS = dict(SPECS["gelu"].choices)["approximate"]


class UnsupportedChain(ValueError):
    """The nodes cannot run as one chain kernel (the caller falls back to something else)."""


@dataclass(frozen=True)
class Step:
    op: str
    reads: tuple[int, ...]
    attrs: tuple[tuple[str, str], ...] = ()

    def attr(self, name: str) -> str:
        return dict(self.attrs)[name]


@dataclass(frozen=True)
class Chain:
    inputs: tuple[str, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]

    def __post_init__(self):
        if not self.steps:
            raise UnsupportedChain("a chain needs at least one step")
        for kind in self.inputs:
            if kind not in ("row", "weight"):
                raise UnsupportedChain(f"input kind must be 'row' or 'weight', got {kind!r}")
        defined = len(self.inputs)
        for step in self.steps:
            arity = {**ELEMENTWISE_OPS, **ROWWISE_OPS}.get(step.op)
            if arity is None:
                raise UnsupportedChain(f"op {step.op!r} has no chain kernel")
            if len(step.reads) != arity:
                raise UnsupportedChain(f"{step.op} reads {arity} values, got {len(step.reads)}")
            for position, slot in enumerate(step.reads):
                if not 0 <= slot < defined:
                    raise UnsupportedChain(f"{step.op} reads slot {slot}, not yet defined")
                as_weight = position in VECTOR_OPERANDS.get(step.op, ())
                is_weight = slot < len(self.inputs) and self.inputs[slot] == "weight"
                if as_weight != is_weight:
                    raise UnsupportedChain(f"{step.op} operand {position} must be a "
                                           f"{'weight input' if as_weight else 'row value'}")
            defined += NUM_RESULTS.get(step.op, 1)
        quantized = {slot for step, slots in zip(self.steps, self.result_slots())
                     if _CHAIN_SPECS[step.op].out_dtype is not None for slot in slots}
        per_row = self.per_row_slots()
        for step in self.steps:
            if set(step.reads) & (quantized - per_row):
                # fp32 flows between steps, so a later step would read the value unquantized
                raise UnsupportedChain("a quantized value may only be stored, not read again")
            if set(step.reads) & per_row:
                # a (rows, 1) value in a (rows, row length) tile: no step is written for that
                raise UnsupportedChain("a per-row value may only be stored, not read again")
        if not self.outputs:
            raise UnsupportedChain("a chain must store at least one value")
        for slot in self.outputs:
            if not len(self.inputs) <= slot < defined:
                raise UnsupportedChain(f"output slot {slot} is not a step result")

    @property
    def rowwise(self) -> bool:
        return any(step.op in ROWWISE_OPS for step in self.steps)

    def result_slots(self) -> list[tuple[int, ...]]:
        """The slots each step defines, in step order."""
        slots, next_slot = [], len(self.inputs)
        for step in self.steps:
            count = NUM_RESULTS.get(step.op, 1)
            slots.append(tuple(range(next_slot, next_slot + count)))
            next_slot += count
        return slots

    def per_row_slots(self) -> frozenset[int]:
        """The slots holding one value per row (shape [..., 1]), not one per element."""
        return frozenset(slots[i] for step, slots in zip(self.steps, self.result_slots())
                         for i in PER_ROW_RESULTS.get(step.op, ()))

    def value_shape(self, slot: int, shape) -> tuple[int, ...]:
        """The shape of a step result when the chain runs on row values of `shape`."""
        shape = tuple(shape)
        return shape[:-1] + (1,) if slot in self.per_row_slots() else shape

    def output_shapes(self, shape) -> list[tuple[int, ...]]:
        return [self.value_shape(slot, shape) for slot in self.outputs]

    def output_dtypes(self, input_dtypes):
        """The dtypes the op references give: an elementwise step promotes its operands as
        torch does (bf16 * an fp32 vector is fp32); a norm keeps its input's dtype; an op
        with an `out_dtype` (a quantization) gives that; a per-row result is fp32."""
        dtypes = list(input_dtypes)
        for step, slots in zip(self.steps, self.result_slots()):
            result = _CHAIN_SPECS[step.op].out_dtype or dtypes[step.reads[0]]
            if step.op not in ROWWISE_OPS and _CHAIN_SPECS[step.op].out_dtype is None:
                for read in step.reads[1:]:
                    result = torch.promote_types(result, dtypes[read])
            per_row = PER_ROW_RESULTS.get(step.op, ())
            dtypes.extend(PER_ROW_DTYPE if i in per_row else result for i in range(len(slots)))
        return [dtypes[slot] for slot in self.outputs]


def step_attrs(op: str, attrs: dict) -> tuple[tuple[str, str], ...]:
    """An op's attributes, defaults filled in, as the literals the generated kernel uses."""
    spec = _CHAIN_SPECS[op]
    defaults, choices = dict(spec.attrs), dict(spec.choices)
    unknown = set(attrs) - set(defaults)
    if unknown:
        raise UnsupportedChain(f"{op}: unsupported attribute(s) {sorted(unknown)}")
    literals = []
    for name, value in sorted({**defaults, **attrs}.items()):
        if name in choices:
            if value not in choices[name]:
                raise UnsupportedChain(f"{op}: {name}={value!r} is not supported")
            literals.append((name, value))
        else:
            try:
                literals.append((name, float_literal(op, name, value)))
            except ValueError as error:
                raise UnsupportedChain(str(error)) from None
    return tuple(literals)


def chain_from_nodes(nodes, inputs, outputs) -> Chain:
    """The chain computing `outputs` from `inputs` by running `nodes` (engine `OpNode`s) in order.

    `inputs` names every value the nodes read but do not produce; raises UnsupportedChain for
    nodes that do not map onto the chain kernel."""
    inputs, outputs = tuple(inputs), tuple(outputs)
    slot_of = {name: slot for slot, name in enumerate(inputs)}
    if len(slot_of) != len(inputs):
        raise UnsupportedChain(f"inputs {inputs} name a value twice")
    kinds = ["row"] * len(inputs)
    steps = []
    next_slot = len(inputs)
    for node in nodes:
        if node.op_type not in ELEMENTWISE_OPS and node.op_type not in ROWWISE_OPS:
            raise UnsupportedChain(f"op {node.op_type!r} has no chain kernel")
        reads = []
        for position, name in enumerate(node.inputs):
            if name not in slot_of:
                raise UnsupportedChain(f"{node.op_type} reads {name!r}, which is neither a chain "
                                       f"input nor produced earlier")
            slot = slot_of[name]
            if position in VECTOR_OPERANDS.get(node.op_type, ()):
                if slot >= len(inputs):
                    raise UnsupportedChain(f"{node.op_type}: the weight {name!r} must be an "
                                           f"input, not a computed value")
                kinds[slot] = "weight"
            reads.append(slot)
        if len(node.outputs) != NUM_RESULTS.get(node.op_type, 1):
            raise UnsupportedChain(f"{node.op_type} defines {NUM_RESULTS.get(node.op_type, 1)} "
                                   f"value(s), got {len(node.outputs)}")
        steps.append(Step(node.op_type, tuple(reads), step_attrs(node.op_type, node.attr_dict)))
        for name in node.outputs:
            slot_of[name] = next_slot
            next_slot += 1
    missing = [name for name in outputs if name not in slot_of]
    if missing:
        raise UnsupportedChain(f"outputs {missing} are never produced")
    return Chain(tuple(kinds), tuple(steps), tuple(slot_of[name] for name in outputs))
