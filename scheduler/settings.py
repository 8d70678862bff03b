"""What the engine is told: an immutable `Settings`, built by the user surface
(infini_dist.config.snapshot()) and handed to the engine, which never reads the flags itself."""

from __future__ import annotations

from dataclasses import dataclass

# agree_every_call: on for CPU tensors or TORCH_DISTRIBUTED_DEBUG=DETAIL; matmul_prologue: on in
# graphs Inductor captures in CUDA graphs (infini_dist/compile/passes.py)
AUTO = "auto"


@dataclass(frozen=True)
class Settings:
    """An immutable snapshot of the flags, taken where a decision depends on them."""
    enable_custom_op_fusion: bool
    custom_op_fusion_types: tuple
    enable_recursive_fusion: bool
    max_fusion_depth: int
    matmul_prologue: bool | str
    row_split: bool
    backward_sites: bool
    fusion_speedup_threshold: float
    max_autotune_threads: int
    benchmark_warmup: int
    benchmark_reps: int
    benchmark_cuda_graphs: bool
    tuning_timeout_s: float
    cache_dir: str
    enable_disk_cache: bool
    debug_mode: bool
    token_buckets: tuple
    max_token_bucket: int
    tune_at_request_time: bool
    agree_every_call: bool | str
    symm_timeout_s: float
    symm_group_items: int
    symm_round_items: int
    symm_preload: bool
    symm_pdl: bool
    fast_launch: bool
    express_ops: bool

    def __hash__(self) -> int:
        # Settings key every executor lookup on an eager op's hot path, and hashing all the
        # fields again each time costs more than the rest of the lookup.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f) for f in self.__dataclass_fields__))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # String hashes differ between processes: a pickled copy hashes afresh.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def decision_fields(self) -> dict:
        """The flags that change which choice is committed, hence part of the cache key."""
        return {"fusion": self.enable_custom_op_fusion, "types": self.custom_op_fusion_types,
                "recursive": self.enable_recursive_fusion, "depth": self.max_fusion_depth,
                "threshold": self.fusion_speedup_threshold,
                "graph_timing": self.benchmark_cuda_graphs}
