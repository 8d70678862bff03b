"""The replacement of a row-split chain (compile/chain_match.py): two torch ops per site.

    h, residual = torch.ops.infini_dist.split_site([x, w, residual, norm_weight], chain, k)
    outs = torch.ops.infini_dist.split_read([h, w0, (b0), w1, ...], chain, k)

`chain` is the chain's JSON text (scheduler/split_chain.chain_text), the same in every op of the
chain, so the compiled code carries it; `k` the site's place in it. The engine runs them in the
mode the chain committed (scheduler/split_chain.py). In the split mode `h` is the site's
gathered buffer, whose peers' rows arrive while the readers' first GEMMs run, and `residual`
holds this rank's rows only: the pass writes these ops only where the chain's own ops are the
sole readers of both.
"""

from __future__ import annotations

import torch

import infini_dist
from infini_dist.compile.runtime_op import evaluate_shapes, fused_site
from infini_dist.scheduler.ir import subgraph_from_text
from infini_dist.scheduler.split_chain import chain_runner, parse_chain

SITE_OP, READ_OP = "infini_dist::split_site", "infini_dist::split_read"


def split_site(inputs: list[torch.Tensor], chain: str, index: int) -> list[torch.Tensor]:
    inputs, runner = list(inputs), chain_runner(chain, infini_dist.config.snapshot())
    if not runner.splits(index, inputs):  # the site as the site pass wrote it
        return fused_site(inputs, runner.sites[index].site)
    return runner.site(index, inputs)


def split_read(inputs: list[torch.Tensor], chain: str, index: int) -> list[torch.Tensor]:
    return chain_runner(chain, infini_dist.config.snapshot()).read(index, list(inputs))


# Plain registrations, as fused_site's (compile/runtime_op.py): they run below autograd only.
_LIBRARY = torch.library.Library("infini_dist", "FRAGMENT")
_LIBRARY.define("split_site(Tensor[] inputs, str chain, int index) -> Tensor[]")
_LIBRARY.define("split_read(Tensor[] inputs, str chain, int index) -> Tensor[]")
_LIBRARY.impl("split_site", split_site, "CompositeExplicitAutograd")
_LIBRARY.impl("split_read", split_read, "CompositeExplicitAutograd")


def _site(chain: str, index: int):
    return parse_chain(chain)[2][index]


@torch.library.register_fake(SITE_OP, lib=_LIBRARY)
def _(inputs, chain, index):
    return evaluate_shapes(subgraph_from_text(_site(chain, index).site), list(inputs))


@torch.library.register_fake(READ_OP, lib=_LIBRARY)
def _(inputs, chain, index):
    site, h = _site(chain, index), inputs[0]
    if not site.readers:
        return [torch.empty_like(h, memory_format=torch.contiguous_format)]
    rows = h.numel() // site.hidden
    return [h.new_empty(rows, n) for n, _, _ in site.readers]
