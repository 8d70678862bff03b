"""Shapes and dtypes of a graph's values, computed without communication or real compute."""

from __future__ import annotations

import torch

from infini_dist.scheduler import op_registry
from infini_dist.scheduler.choices import TensorMeta


def _custom_op_call(name: str, tensors: list, attrs: dict):
    """A user anchor op under fake tensors: its torch.library fake if it has one, else its ref."""
    namespace, _, op_name = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), op_name, None) if op_name else None
    if packet is not None:
        return packet(*tensors, **attrs)
    return op_registry.get_op(name).fn(*tensors, **attrs)


def shape_env(nodes, env: dict) -> dict:
    """`env` plus every node's outputs, for fake or meta tensors: a collective gives its fake
    outputs (op_registry.fake_outputs), a user anchor its fake, any other op its reference."""
    env = dict(env)
    for node in nodes:
        tensors = [env[name] for name in node.inputs]
        spec = op_registry.get_op(node.op_type)
        if spec.kind == "collective":
            results = op_registry.fake_outputs(node.op_type, tensors, node.attr_dict)
        elif spec.kind == "custom":
            results = _custom_op_call(node.op_type, tensors, node.attr_dict)
        else:
            results = op_registry.run_node(node.op_type, tensors, node.attr_dict)
        results = results if isinstance(results, (tuple, list)) else (results,)
        env.update(zip(node.outputs, results))
    return env


def site_meta(graph, region, values: dict, device: torch.device) -> dict[str, TensorMeta]:
    """The meta of every value a site reads or makes, for real inputs, run on the meta device."""
    env = {n: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
           for n, v in values.items()}
    env = shape_env([graph.nodes[i] for i in region], env)
    meta = {n: TensorMeta(tuple(v.shape), v.dtype, device, v.is_contiguous())
            for n, v in env.items() if isinstance(v, torch.Tensor)}
    meta.update({n: TensorMeta.of(v) for n, v in values.items() if isinstance(v, torch.Tensor)})
    return meta
