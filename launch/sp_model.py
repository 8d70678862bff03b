"""A Llama-style model (tiny by default: tests; launch/bench_sp.py times it at Llama sizes),
sharded the way torch's TP tutorial shards Llama 2, with sequence parallelism: norms run on
sequence shards (SequenceParallel), attention and MLP inputs are all-gathered
(PrepareModuleInput Shard(1) -> Replicate), and the row-parallel linears
reduce-scatter back to sequence shards (RowwiseParallel(output_layouts=Shard(1))).

So each layer's forward holds all_gather(norm(x)) and reduce_scatter -> add + RMSNorm ->
all_gather, the last layer ending in reduce_scatter -> add + the final RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.wq, self.wk, self.wv))  # -1: the heads of this rank
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(attn.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int, head_dim: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, head_dim)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Model(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 16, hidden: int = 32, head_dim: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, hidden, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        with torch.no_grad():  # norms that are not the identity, so a lost weight shows
            for module in self.modules():
                if isinstance(module, nn.RMSNorm):
                    module.weight.add_(0.1 * torch.randn(dim))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def shard(model: Model, mesh) -> Model:
    """The TP tutorial's plan (sequence dim 1), every module's output a local tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": gather,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    return parallelize_module(model, mesh, {"norm": SequenceParallel(use_local_output=True)})
