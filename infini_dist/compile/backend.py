"""`torch.compile(model, backend="infini_dist")`: the same pass without Inductor.

AOTAutograd traces the forward with Inductor's decompositions (so the graph has the same forms
the post-grad pass sees), the pass rewrites it, and the rewritten FX graph runs eagerly. Useful
where Inductor's code generation is not wanted or not available; the sites are the same.
"""

from __future__ import annotations

import torch

import infini_dist
from infini_dist.compile.passes import fuse_sites

BACKEND_NAME = "infini_dist"


def _forward_compiler(gm: torch.fx.GraphModule, example_inputs):
    if fuse_sites(gm.graph, infini_dist.config.snapshot()):
        gm.recompile()
    return gm


def _backward_compiler(gm: torch.fx.GraphModule, example_inputs):
    return gm


def infini_dist_backend(gm: torch.fx.GraphModule, example_inputs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    compiler = aot_autograd(fw_compiler=_forward_compiler, bw_compiler=_backward_compiler,
                            decompositions=select_decomp_table())
    return compiler(gm, example_inputs)


def register() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(infini_dist_backend, name=BACKEND_NAME)
