"""Anchors in a post-grad FX graph: the functional collectives (all_reduce, reduce_scatter,
all_gather, each with its wait) and calls to user ops registered with infini_dist, as IR ops.
compile/passes hands each to the module of its kind, which grows its site (all_reduce_match,
scatter_gather_match; compile/matching has the walk they share)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from infini_dist.scheduler import op_registry

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
# functional collective -> (IR op, its arguments after the input; "op" must be a sum)
COLLECTIVES = {ALL_REDUCE: ("all_reduce", ("op", "group_name")),
               REDUCE_SCATTER: ("reduce_scatter", ("op", "group_size", "group_name")),
               ALL_GATHER: ("all_gather", ("group_size", "group_name"))}
_ATTR_TYPES = (bool, int, float, str, type(None))


@dataclass
class FxOp:
    """One IR op (scheduler/ir.py OpNode) as found in an FX graph: its FX values and nodes."""
    op_type: str
    inputs: list  # graph value per IR input
    outputs: list  # graph node carrying each IR output (None: nothing reads it)
    attrs: dict
    nodes: frozenset  # graph nodes it replaces

    @property
    def projections(self) -> frozenset:
        """Nodes that only hand on the anchor's result (wait_tensor, getitem)."""
        return frozenset(n for n in self.nodes
                         if n.target is WAIT or n.target is operator.getitem)


def value_of(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor(node) -> bool:
    return isinstance(value_of(node), torch.Tensor)


# Devices whose algorithms are there for speed. On such a device a site that only native could
# run runs what Inductor runs without the site, plus the op's dispatch, and cuts Inductor's
# fusions across the site's edges (an RMSNorm's reduction from its weight's multiply). The CPU
# backend is there to test the sites' structure and native numerics, so CPU sites are made
# regardless.
SPEED_DEVICES = frozenset({"cuda"})


def speed_device(anchor: FxOp) -> torch.device | None:
    """The anchor's device where it is one of SPEED_DEVICES, else None."""
    device = getattr(value_of(anchor.inputs[0]) if anchor.inputs else None, "device", None)
    return device if device is not None and device.type in SPEED_DEVICES else None


def anchor_names() -> frozenset:
    """Registered user ops that are anchors (they have several implementations)."""
    return frozenset(name for name in op_registry.registered_ops()
                     if op_registry.get_op(name).is_anchor)


def is_collective(node: fx.Node, custom: frozenset) -> bool:
    """Nodes a site may not be moved across: they talk to other ranks in program order."""
    if node.op != "call_function" or node.target is WAIT:
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        namespace = target.namespace
        return (namespace in ("_c10d_functional", "c10d", "c10d_functional", "infini_dist")
                or target._schema.name in custom)
    return False


def collective_anchor(node: fx.Node) -> FxOp | None:
    """A functional all_reduce, reduce_scatter_tensor or all_gather_into_tensor (a sum where it
    reduces) whose result is only waited on, as its IR op."""
    if node.op != "call_function" or node.target not in COLLECTIVES:
        return None
    op_type, names = COLLECTIVES[node.target]
    source, values = node.args[0], node.args[1:1 + len(names)]
    if len(values) != len(names):
        return None
    attrs = dict(zip(names, values))
    if "op" in attrs:
        attrs["op"] = str(attrs["op"]).lower()
    users = list(node.users)
    if (attrs.get("op", "sum") != "sum" or not isinstance(attrs["group_name"], str)
            or not isinstance(attrs.get("group_size", 1), int)
            or not is_tensor(source) or len(users) != 1 or users[0].target is not WAIT):
        return None
    waits = [users[0]]
    while len(waits[-1].users) == 1 and next(iter(waits[-1].users)).target is WAIT:
        waits.append(next(iter(waits[-1].users)))  # dynamo may wait again on the waited value
    return FxOp(op_type, [source], [waits[-1]], attrs, frozenset([node, *waits]))


def custom_anchor(node: fx.Node, custom: frozenset) -> FxOp | None:
    """A call to a user op registered under its qualified name ('ns::op'). The engine calls
    implementations as fn(*tensors, **attrs), so every tensor argument must come first."""
    target = node.target
    if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
            or target._schema.name not in custom):
        return None
    schema = target._schema
    tensors, attrs = [], {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            value = node.args[index]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            return None
        if isinstance(value, fx.Node):
            if attrs or not is_tensor(value):
                return None
            tensors.append(value)
        elif isinstance(value, _ATTR_TYPES):
            attrs[argument.name] = value
        else:
            return None
    spec = op_registry.get_op(schema.name)
    if len(schema.returns) != spec.num_outputs:
        return None
    if isinstance(value_of(node), torch.Tensor):
        return FxOp(schema.name, tensors, [node], attrs, frozenset((node,)))
    outputs = [None] * spec.num_outputs
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        outputs[user.args[1]] = user
    return FxOp(schema.name, tensors, outputs, attrs, frozenset([node, *node.users]))
