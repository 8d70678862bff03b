"""Ready-made SubGraphs for the patterns LLM inference spends its small-op time on."""

from infini_dist.fusion.patterns.llm_patterns import (create_add_rms_norm_pattern,
                                                      create_all_reduce_add_rms_norm_pattern,
                                                      create_all_reduce_relu_scale_pattern,
                                                      create_gelu_pattern, create_swiglu_pattern)

__all__ = ["create_swiglu_pattern", "create_add_rms_norm_pattern", "create_gelu_pattern",
           "create_all_reduce_relu_scale_pattern", "create_all_reduce_add_rms_norm_pattern"]
