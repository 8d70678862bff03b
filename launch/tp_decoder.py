"""The model `bench --model` times: a Llama-style decoder, tensor-parallel over one group.

Random weights. Per layer qkv and gate/up are column-parallel, o_proj and down_proj row-parallel;
each row-parallel output goes through an all_reduce, then the residual add and the next RMSNorm:

    residual = all_reduce(o_proj(attention(h))) + residual;  h = mlp_norm(residual)
    residual = all_reduce(down(silu(gate(h)) * up(h))) + residual;  h = next_norm(residual)

In compiled code the all_reduce is funcol's, so the infini_dist pass finds both sites of every
layer; the eager variant calls NCCL in place instead. GQA attention: prefill is causal SDPA over
the prompt; decode (one token) writes its K/V into a static cache at a position held in a tensor
and attends over the whole cache, masked past that position, so a step can be graph-captured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    context: int
    eps: float = 1e-6


def check_shapes(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError naming every size that cannot be split over `tp` ranks."""
    if min(asdict(cfg).values()) <= 0:
        raise ValueError(f"every size must be positive, got {asdict(cfg)}")
    problems = []
    if cfg.hidden % cfg.heads:
        problems.append(f"--hidden {cfg.hidden} is not a multiple of --heads {cfg.heads}")
    if cfg.heads % cfg.kv_heads:
        problems.append(f"--heads {cfg.heads} is not a multiple of --kv-heads {cfg.kv_heads}")
    for flag, value in (("--heads", cfg.heads), ("--kv-heads", cfg.kv_heads), ("--mlp", cfg.mlp)):
        if value % tp:
            problems.append(f"{flag} {value} is not divisible by the tensor-parallel size {tp}")
    if problems:
        raise ValueError("; ".join(problems))


def rms_norm(x, weight, eps):
    # Llama's spelling: normalise in fp32, round to the input dtype, then scale.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Layer(nn.Module):
    """One decoder layer's shard: q_heads/kv_heads/mlp columns of this rank."""

    def __init__(self, cfg: ModelConfig, tp: int, own, shared, device, dtype):
        super().__init__()
        d = self.head_dim = cfg.hidden // cfg.heads
        self.q_heads, self.kv_heads, mlp = cfg.heads // tp, cfg.kv_heads // tp, cfg.mlp // tp

        def weight(rows, cols, fan_in):  # fan_in of the full (unsharded) matrix: unit-scale sums
            w = torch.randn(rows, cols, generator=own, device=device) / math.sqrt(fan_in)
            return nn.Parameter(w.to(dtype), requires_grad=False)

        def norm():  # replicated: the same on every rank
            w = 1.0 + 0.1 * torch.randn(cfg.hidden, generator=shared, device=device)
            return nn.Parameter(w.to(dtype), requires_grad=False)
        self.wqkv = weight((self.q_heads + 2 * self.kv_heads) * d, cfg.hidden, cfg.hidden)
        self.wo = weight(cfg.hidden, self.q_heads * d, cfg.heads * d)
        self.w_gate_up = weight(2 * mlp, cfg.hidden, cfg.hidden)
        self.w_down = weight(cfg.hidden, mlp, cfg.mlp)
        self.attn_norm, self.mlp_norm = norm(), norm()

    def attention(self, h, pos, cache):
        """Partial o_proj output (before the all_reduce). cache None: causal prefill."""
        b, s, _ = h.shape
        d, kvh = self.head_dim, self.kv_heads
        q, k, v = F.linear(h, self.wqkv).split([self.q_heads * d, kvh * d, kvh * d], dim=-1)
        q = q.view(b, s, self.q_heads, d).transpose(1, 2)
        k = k.view(b, s, kvh, d).transpose(1, 2)
        v = v.view(b, s, kvh, d).transpose(1, 2)
        if cache is None:
            group = self.q_heads // kvh  # query head i reads KV head i // group
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k_cache, v_cache = cache
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            # Each KV head serves its `group` query heads in one matmul: (b, kvh, group, T).
            scores = (q.reshape(b, kvh, -1, d) @ k_cache.transpose(-1, -2)).float() * d ** -0.5
            visible = torch.arange(k_cache.shape[2], device=h.device) <= pos
            p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(h.dtype)
            o = (p @ v_cache).reshape(b, self.q_heads, s, d)
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), self.wo)

    def mlp(self, h):
        gate, up = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, group, device, dtype):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.group_name = group.group_name
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        own = torch.Generator(device=device).manual_seed(1000 + rank)
        shared = torch.Generator(device=device).manual_seed(7)
        self.layers = nn.ModuleList(Layer(cfg, tp, own, shared, device, dtype)
                                    for _ in range(cfg.layers))
        self.final_norm = nn.Parameter(
            (1.0 + 0.1 * torch.randn(cfg.hidden, generator=shared, device=device)).to(dtype),
            requires_grad=False)

    def all_reduce(self, x, eager_nccl: bool):
        if eager_nccl:
            dist.all_reduce(x, group=self.group)  # in place: x is a fresh projection output
            return x
        return funcol.all_reduce(x, "sum", self.group_name)

    def column_input(self, h):
        """Where h enters the column-parallel projections (training reduces its gradient)."""
        return h

    def forward(self, x, pos=None, caches=None, eager_nccl: bool = False):
        """x (batch, tokens, hidden) replicated; decode: tokens == 1, pos (1,), caches per layer
        (k, v) of (batch, kv_heads/TP, context, head_dim). Returns the final normed hidden."""
        eps = self.cfg.eps
        residual = x
        h = rms_norm(x, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            residual = self.all_reduce(layer.attention(self.column_input(h), pos, cache),
                                       eager_nccl) + residual
            h = rms_norm(residual, layer.mlp_norm, eps)
            residual = self.all_reduce(layer.mlp(self.column_input(h)), eager_nccl) + residual
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) \
                else self.final_norm
            h = rms_norm(residual, following, eps)
        return h


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode" or "prefill"
    batch: int
    tokens: int

    @property
    def name(self) -> str:
        return f"decode b{self.batch}" if self.kind == "decode" else f"prefill {self.tokens}"


def make_inputs(cfg: ModelConfig, model: Decoder, shape: Shape, device, dtype):
    """(x, pos, caches): x replicated; cache contents differ per rank (own KV heads)."""
    shared = torch.Generator(device=device).manual_seed(11 + shape.batch * 7 + shape.tokens)
    x = torch.randn(shape.batch, shape.tokens, cfg.hidden, generator=shared, device=device)
    if shape.kind == "prefill":
        return x.to(dtype), None, None
    own = torch.Generator(device=device).manual_seed(5000 + dist.get_rank())
    layer = model.layers[0]
    size = (shape.batch, layer.kv_heads, cfg.context, layer.head_dim)
    caches = [tuple(torch.randn(size, generator=own, device=device).to(dtype) for _ in "kv")
              for _ in range(cfg.layers)]
    pos = torch.tensor([cfg.context - 1], device=device)  # the last slot: the whole cache visible
    return x.to(dtype), pos, caches
