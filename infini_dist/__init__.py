"""infini_dist: collectives fused with the work around them, chosen by cross-rank benchmarks."""

__version__ = "0.1.0"

from infini_dist import config  # noqa: E402  (flags first: everything else reads them)

__all__ = ["config", "warmup", "__version__"]


def __getattr__(name):
    # Submodules load on first use, so `import infini_dist` stays cheap and free of cycles.
    import importlib
    if name in ("ops", "fusion", "compile", "scheduler", "kernels", "launch"):
        return importlib.import_module(f"infini_dist.{name}")
    if name == "warmup":
        from infini_dist.serving import warmup
        return warmup
    raise AttributeError(f"module 'infini_dist' has no attribute {name!r}")
