"""Host cost of compiled sites, on one GPU: 8 row-parallel layers (matmul, all_reduce, residual
add, RMSNorm) compiled plainly, and with the pass with every site forced to a choice, the
compiled code kept (recompile_decided=False) or compiled again by compile_model once the sites
decided. NCCL with one rank: the all_reduce is a real NCCL call
(its host cost is the user's too) that moves nothing, so the table isolates host time.

    python -m infini_dist.launch.bench_site_host --tokens 1,2048

µs per forward (no CUDA graphs, no_grad, bf16, hidden 4096): `host` is the median time for a
call to return, `wall` the mean with the GPU work included (synchronised at the end).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

LAYERS = 8


def norm(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, group_name: str):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.group_name = group_name
        self.ws = torch.nn.ParameterList(
            torch.nn.Parameter((torch.randn(hidden, hidden, generator=g) / hidden ** 0.5)
                               .cuda().bfloat16()) for _ in range(LAYERS))
        self.gs = torch.nn.ParameterList(
            torch.nn.Parameter((1 + 0.1 * torch.randn(hidden, generator=g)).cuda().bfloat16())
            for _ in range(LAYERS))

    def forward(self, x, residual):
        for w, g in zip(self.ws, self.gs):
            residual = funcol.wait_tensor(funcol.all_reduce(x @ w, "sum", self.group_name)) \
                + residual
            x = norm(residual, g)
        return x, residual


def matching(pattern: str):
    """A timing hook: the choices whose names match `pattern` win."""
    return lambda medians: {n: 1.0 if re.search(pattern, n) else 2.0 for n in medians}


def deepest(prefix: str):
    """A timing hook: at each site the fused `prefix` choice with the deepest epilogue wins
    (the one that runs the whole site in one launch)."""
    def hook(medians):
        depth = {n: int(re.search(r"e(\d+)\]$", n).group(1)) for n in medians
                 if n.startswith(prefix + "[") and re.search(r"e(\d+)\]$", n)}
        best = max(depth.values(), default=None)
        return {n: 0.5 if depth.get(n, -1) == best else 2.0 for n in medians}
    return hook


def timed(fn, args, calls: int = 200) -> tuple[float, float]:
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    host, start = [], time.perf_counter()
    for _ in range(calls):
        begin = time.perf_counter()
        fn(*args)
        host.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    return statistics.median(host) * 1e6, (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2048")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--one-rank-symm", action="store_true",
                        help="also every site fused into two_shot_polled_gather at world size "
                             "1, through the eager ops' C++ path and without it")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    import torch._dynamo.config as dynamo_config

    import infini_dist
    import infini_dist.compile as idc
    from infini_dist.scheduler.store import STORE
    dynamo_config.cache_size_limit = 64
    if args.one_rank_symm:
        from infini_dist.kernels import express
        from infini_dist.launch.bench_eager import allow_one_rank
        allow_one_rank()
        express.start(wait=True)
    block = Block(args.hidden, dist.group.WORLD.group_name)
    print(f"{torch.cuda.get_device_name()}: {LAYERS} sites, hidden {args.hidden}")
    print("| tokens | variant | host µs | wall µs | rel. error vs eager |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for index, tokens in enumerate(int(t) for t in args.tokens.split(",")):
            x, residual = (torch.randn(tokens, args.hidden, device="cuda").bfloat16()
                           for _ in range(2))
            ref = block(x, residual)[0].double()
            torch._dynamo.reset()
            rows = {"plain compile": timed(torch.compile(block), (x, residual)) + ("",)}
            variants = [("every site nccl+nt_epilogue", matching(r"nccl\+nt_epilogue"), False,
                         True),
                        ("every site native", matching(r"^native$"), False, True),
                        ("native, compile_model's own recompiles", matching(r"^native$"), True,
                         True)]
            if args.one_rank_symm:
                variants += [(f"every site two_shot_polled_gather, {path} path",
                              deepest("two_shot_polled_gather"), False, path == "C++")
                             for path in ("C++", "Python")]
            for number, (variant, hook, recompile, express_ops) in enumerate(variants):
                # settings of their own: fresh executors and decision-cache keys per variant
                threshold = 1.0 + 1e-6 * (1 + index * 10 + number)
                with infini_dist.config.patch(fusion_speedup_threshold=threshold,
                                              express_ops=express_ops):
                    STORE.timing_hook = hook
                    torch._dynamo.reset()
                    compiled = idc.compile_model(block, recompile_decided=recompile)
                    error = float((compiled(x, residual)[0].double() - ref).norm() / ref.norm())
                    for _ in range(3):  # decisions, and the compiles they cause
                        compiled(x, residual)
                    note = f", {idc.recompiles(compiled)} recompiles" if recompile else ""
                    rows[f"pass, {variant}"] = timed(compiled, (x, residual)) + (
                        f"{error:.1e}{note}",)
            STORE.timing_hook = None
            for name, (host, wall, error) in rows.items():
                print(f"| {tokens} | {name} | {host:.1f} | {wall:.1f} | {error} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
