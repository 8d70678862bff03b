"""`torch.compile(model, backend="infini_dist")`: the same pass without Inductor.

AOTAutograd traces the forward and backward with Inductor's decompositions (so the graphs have
the same forms the post-grad pass sees), the pass rewrites both, and the rewritten FX graphs run
eagerly. Useful where Inductor's code generation is not wanted or not available; the sites are
the same.
"""

from __future__ import annotations

import torch

import infini_dist
from infini_dist.compile.passes import fuse_sites

BACKEND_NAME = "infini_dist"


def _rewrite(gm: torch.fx.GraphModule, example_inputs):
    """The pass on a forward or backward graph. Inductor's no-op removal runs first, as it does
    before the post-grad pass: with grad enabled DTensor leaves a same-shape view between
    wait_tensor and the residual add, which would hide the epilogue."""
    from functorch.compile import make_boxed_func
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    remove_noop_ops(gm.graph)
    fuse_sites(gm.graph, infini_dist.config.snapshot())
    gm.recompile()
    return make_boxed_func(gm.forward)  # boxed: AOTAutograd may free inputs as it goes


def infini_dist_backend(gm: torch.fx.GraphModule, example_inputs):
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    # Inductor's partitioner: the forward saves what it would save (the norm's rsqrt, not also
    # the normalized value the default partitioner keeps), so training sites are the same.
    compiler = aot_autograd(fw_compiler=_rewrite, bw_compiler=_rewrite,
                            partition_fn=min_cut_rematerialization_partition,
                            decompositions=select_decomp_table())
    return compiler(gm, example_inputs)


def register() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(infini_dist_backend, name=BACKEND_NAME)
