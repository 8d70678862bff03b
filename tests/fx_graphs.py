"""Post-grad graphs for the compile-pass tests (test_compile*.py): graphs as AOTAutograd hands
them to Inductor, from aot_export_module with Inductor's decompositions (functional,
decomposed, with fake-tensor metadata: the form post-grad passes see), and the pass run on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import infini_dist
import infini_dist.compile as idc
from infini_dist.compile import runtime_op

c10d = torch.ops._c10d_functional
FUSED = torch.ops.infini_dist.fused_site.default


def ar(x, group="g0"):
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        out = self.fn(*args)
        return out if isinstance(out, tuple) else (out,)


def export(fn, *args):
    from torch._functorch.aot_autograd import aot_export_module
    from torch._inductor.decomposition import select_decomp_table
    gm, _ = aot_export_module(_Wrap(fn), args, trace_joint=False,
                              decompositions=select_decomp_table())
    for node in list(gm.graph.nodes):  # export's dtype asserts; Inductor drops them pre-pass
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def assert_unchanged(rewrite, fn, *args):
    """A graph rewrite (compile/reshape_first.py, compile/block_sum_first.py) that finds nothing
    to rewrite in fn's graph, and leaves it as it was."""
    gm = export(fn, *args)
    before = [n.target for n in gm.graph.nodes]
    assert rewrite(gm.graph) == 0
    assert [n.target for n in gm.graph.nodes] == before


def fuse(gm, **flags):
    with infini_dist.config.patch(**flags):
        texts = idc.fuse_sites(gm.graph, infini_dist.config.snapshot())
    gm.recompile()
    return [runtime_op.subgraph_from_text(t) for t in texts]


def ops_of(sub):
    return [n.op_type for n in sub.nodes]


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def llama_norm(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def torch_norm(x, w, eps=1e-6):
    return F.rms_norm(x, (x.shape[-1],), w, eps)
