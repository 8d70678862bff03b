"""A small HF Llama saved with save_pretrained (random weights, no download), for the tests that
load it the way transformers' TP users do (from_pretrained with a TP plan)."""

from __future__ import annotations

import torch


def save_llama(path: str, *, jitter_norms: bool = True, **sizes) -> str:
    """LlamaConfig(**sizes) with random weights at `path`; jitter_norms moves the norms' weights
    off their init, so that a lost norm weight shows."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**sizes))
    if jitter_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path
