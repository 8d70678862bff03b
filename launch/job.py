"""One benchmark job's start and its record: the process groups, the compile caches every
bench turns off, and what results.json says of the run (the benches of launch/ share both)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def setup(args):
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    # One compiled entry per (variant, shape) on the same forward: past the default limit of 8
    # Dynamo would silently fall back to eager.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
    # A cache hit skips the post-grad pass, and then the site counts would read 0.
    inductor_config.fx_graph_cache = False
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = False
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
        return device, dtype, dist.group.WORLD
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device, torch.bfloat16, dist.new_group(backend="gloo")


def dynamo_compiles() -> int:
    """Graphs Dynamo has compiled in this process so far: a bench reads it around a phase to
    see whether that phase compiled (timed calls must not)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def run_meta(args, device, dtype, started: float) -> dict:
    """What results.json says about the run itself."""
    meta = {"world_size": dist.get_world_size(), "dtype": str(dtype).replace("torch.", ""),
            "variants": args.variants, "iters": args.iters,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cpu_smoke": args.cpu_smoke, "tol": args.tol,
            "wall_s": time.perf_counter() - started}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta
