"""The IR: op nodes, subgraphs, their canonical text and stable cache keys. Where a graph's
collectives and the nodes that may fuse with them are: scheduler/boundary.py."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from infini_dist.scheduler import op_registry

_ATTR_TYPES = (bool, int, float, str, type(None))


def as_names(value: Any, what: str, noun: str = "names") -> tuple[str, ...]:
    """`value` as a tuple of non-empty strings, or a TypeError saying what was wrong."""
    # A bare string is iterable, so tuple("x_in") would silently become four names.
    if isinstance(value, str):
        raise TypeError(f"{what} must be a collection of {noun}, got the bare string {value!r}; "
                        f"write ({value!r},)")
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{what} must be a collection of {noun}, got "
                        f"{type(value).__name__}") from None
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{what} must hold non-empty {noun}, got {name!r}")
    return names


def _freeze_attr(key: str, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze_attr(key, v) for v in value)
    if not isinstance(value, _ATTR_TYPES):
        raise TypeError(f"attribute {key!r} must be a bool, int, float, str, None or a tuple of "
                        f"those, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class OpNode:
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if not isinstance(self.op_type, str) or not self.op_type:
            raise TypeError(f"op_type must be a non-empty string, got {self.op_type!r}")
        object.__setattr__(self, "inputs", as_names(self.inputs, f"{self.op_type}: inputs"))
        object.__setattr__(self, "outputs", as_names(self.outputs, f"{self.op_type}: outputs"))
        attrs = self.attrs
        items = attrs.items() if isinstance(attrs, Mapping) else attrs
        frozen = tuple(sorted((str(k), _freeze_attr(k, v)) for k, v in items))
        object.__setattr__(self, "attrs", frozen)

    def attr(self, name: str, default: Any = None) -> Any:
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def canonical(self) -> list:
        return [self.op_type, list(self.inputs), list(self.outputs),
                [[k, _canonical_value(v)] for k, v in self.attrs]]


def _canonical_value(value: Any) -> Any:
    # repr() of a float is exact and identical in every process; json floats are not guaranteed.
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, tuple):
        return [_canonical_value(v) for v in value]
    return value



def _attr_value(value: Any) -> Any:
    # Inverse of _canonical_value: floats travel as {"float": repr}, tuples as lists.
    if isinstance(value, dict):
        if set(value) != {"float"}:
            raise ValueError(f"unexpected attribute encoding {value!r}")
        return float(value["float"])
    if isinstance(value, list):
        return tuple(_attr_value(v) for v in value)
    return value

@dataclass(frozen=True)
class SubGraph:
    nodes: tuple[OpNode, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def __post_init__(self):
        nodes = self.nodes
        if isinstance(nodes, OpNode):
            nodes = (nodes,)
        nodes = tuple(nodes)
        for node in nodes:
            if not isinstance(node, OpNode):
                raise TypeError(f"SubGraph nodes must be OpNode, got {type(node).__name__}")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "input_names", as_names(self.input_names, "input_names"))
        object.__setattr__(self, "output_names", as_names(self.output_names, "output_names"))
        self._validate()

    def _validate(self):
        defined = set()
        for name in self.input_names:
            if name in defined:
                raise ValueError(f"graph input {name!r} is listed twice")
            defined.add(name)
        for index, node in enumerate(self.nodes):
            spec = op_registry.get_op(node.op_type)  # raises for an unknown op
            for name in node.inputs:
                if name not in defined:
                    raise ValueError(f"node {index} ({node.op_type}) reads {name!r}, which is "
                                     f"neither a graph input nor produced by an earlier node")
            expected = len(node.inputs) if spec.outputs_per_input else spec.num_outputs
            if len(node.outputs) != expected:
                raise ValueError(f"node {index} ({node.op_type}) must have {expected} output(s), "
                                 f"got {len(node.outputs)}")
            if spec.num_inputs is not None and len(node.inputs) != spec.num_inputs:
                raise ValueError(f"node {index} ({node.op_type}) takes {spec.num_inputs} input(s), "
                                 f"got {len(node.inputs)}")
            for name in node.outputs:
                if name in defined:
                    raise ValueError(f"value {name!r} is defined twice (node {index}, "
                                     f"{node.op_type})")
                defined.add(name)
        for name in self.output_names:
            if name not in defined:
                raise ValueError(f"graph output {name!r} is never produced")

    def __hash__(self):
        # Hashed on every eager call (executor lookup); the nested tuples never change.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.nodes, self.input_names, self.output_names))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self):
        # str hashes differ between processes: never carry a cached hash across a pickle.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def canonical(self) -> str:
        return json.dumps({"nodes": [n.canonical() for n in self.nodes],
                           "inputs": list(self.input_names),
                           "outputs": list(self.output_names)}, sort_keys=True,
                          separators=(",", ":"))

    def signature(self) -> str:
        """sha256 of the structure alone: equal in every process for equal graphs."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def cache_key(self, dtypes: Iterable[Any], shapes: Iterable[Iterable[int]],
                  **extra: Any) -> str:
        payload = json.dumps({"graph": self.canonical(),
                              "dtypes": [str(d) for d in dtypes],
                              "shapes": [[int(s) for s in shape] for shape in shapes],
                              "extra": {k: str(v) for k, v in sorted(extra.items())}},
                             sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    # Derived facts, computed on demand (frozen dataclass: no caches on the instance).
    def producers(self) -> dict[str, int]:
        return {name: i for i, node in enumerate(self.nodes) for name in node.outputs}

    def consumers(self) -> dict[str, list[int]]:
        users: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in node.inputs:
                users.setdefault(name, []).append(i)
        return users


@functools.lru_cache(maxsize=4096)
def subgraph_from_text(text: str) -> SubGraph:
    """The SubGraph whose `canonical()` is `text` (validated again on construction): a compiled
    site's graph, which travels in the compiled code as its text."""
    try:
        data = json.loads(text)
        nodes = tuple(OpNode(op, tuple(inputs), tuple(outputs),
                             {key: _attr_value(value) for key, value in attrs})
                      for op, inputs, outputs, attrs in data["nodes"])
        graph = SubGraph(nodes, tuple(data["inputs"]), tuple(data["outputs"]))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"infini_dist.fused_site: not a canonical SubGraph ({error}): "
                         f"{text[:200]!r}") from None
    if graph.canonical() != text:
        raise ValueError(f"infini_dist.fused_site: graph text is not in canonical form: "
                         f"{text[:200]!r}")
    return graph
