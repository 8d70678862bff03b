"""A tiny Llama-style decoder block, sharded with torch's own tensor parallelism.

    h = x + wo(attention(wq, wk, wv of attn_norm(x)))     wo row-parallel: all_reduce, add, norm
    y = h + down(silu(gate(m)) * up(m)), m = mlp_norm(h)  down row-parallel: all_reduce, add, norm
    return final_norm(y)

So the compiled graph has two all_reduce sites, each followed by residual add + RMSNorm. The
norms are written two ways on purpose: Llama's (fp32, round, then weight) and nn.RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, head_dim: int = 4):
        super().__init__()
        self.head_dim = head_dim
        self.attn_norm = LlamaRMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-5)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.final_norm = LlamaRMSNorm(dim)
        with torch.no_grad():  # norms that are not the identity, so a lost weight shows
            for norm in (self.attn_norm, self.mlp_norm, self.final_norm):
                norm.weight.add_(0.1 * torch.randn(dim))

    def forward(self, x):
        batch, seq, _ = x.shape
        n = self.attn_norm(x)
        q, k, v = (proj(n).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.wq, self.wk, self.wv))  # -1: the heads of this rank
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.wo(attn.transpose(1, 2).reshape(batch, seq, -1))
        m = self.mlp_norm(h)
        y = h + self.down(F.silu(self.gate(m)) * self.up(m))
        return self.final_norm(y)


def shard(block: Block, mesh) -> Block:
    """Megatron-style: q/k/v and gate/up column-parallel, wo and down row-parallel."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(), "gate": ColwiseParallel(), "up": ColwiseParallel(),
            "down": RowwiseParallel()}
    return parallelize_module(block, mesh, plan)
