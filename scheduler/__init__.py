"""The engine: IR, boundaries, choice generation, cross-rank benchmark, commit and cache."""

from infini_dist.scheduler.ir import OpNode, Site, SubGraph, find_sites
from infini_dist.scheduler.op_registry import get_op, register_op
from infini_dist.scheduler.choices import (Algorithm, Choice, FusedSpan, RunContext, TensorMeta,
                                           algorithms_for, generate_choices, register_algorithm)
from infini_dist.scheduler.engine import GraphExecutor, TuningError, executor_for
from infini_dist.scheduler import torch_fused  # noqa: F401  (registers the CPU algorithms)

__all__ = ["OpNode", "Site", "SubGraph", "find_sites", "get_op", "register_op", "Algorithm",
           "Choice", "FusedSpan", "RunContext", "TensorMeta", "algorithms_for",
           "generate_choices", "register_algorithm", "GraphExecutor", "TuningError",
           "executor_for"]
