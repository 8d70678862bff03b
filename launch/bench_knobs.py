"""The symmetric-memory kernels' launch knobs, swept: num_warps, and the two-shot kernels' items
per step (`SymmTuning(group_items=)`), each variant checked against the fp32 reference and for
bitwise identical outputs on every rank, then timed under CUDA-graph replay (µs per call, max
over ranks). For kernel work: the engine does not tune these knobs, the layouts pick them.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_knobs [--kernels K,..]

AR + residual add + RMSNorm, bf16, hidden 4096: one_shot_lamport at 1 / 16 / 128 tokens (with
and without static FP8), two_shot_polled_gather and two_shot at 1024 / 8192 tokens,
one_shot_lamport_streamed at 1 to 8192 tokens. `--kernels`: only these kernels (by kind).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from infini_dist.kernels.lamport_one_shot import lamport_one_shot_all_reduce
from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from infini_dist.kernels.symm_device import SymmTuning
from infini_dist.kernels.two_shot_all_reduce import two_shot_all_reduce
from infini_dist.kernels.two_shot_polled_gather import two_shot_polled_gather_all_reduce
from infini_dist.launch.bench import Timer
from infini_dist.launch.bench_eager import inputs_for

HIDDEN, FP8_SCALE = 4096, 0.05


def cases():
    for tokens in (1, 16, 128):
        for quant in (None, ("quant_fp8", FP8_SCALE)):
            for warps in (None, 4, 16):
                yield lamport_one_shot_all_reduce, tokens, quant, 0, warps
    for kernel in (two_shot_polled_gather_all_reduce, two_shot_all_reduce):
        for tokens in (1024, 8192):
            for group in (0, 2, 4, 8):
                for warps in (None, 16, 32):
                    yield kernel, tokens, None, group, warps
    for tokens in (1, 16, 128, 1024, 8192):
        for group in (0, 2):
            for warps in (None, 4, 8, 16):
                yield lamport_one_shot_streamed_all_reduce, tokens, None, group, warps


def error_and_agreement(out, x, residual, weight, quant) -> tuple[float, bool]:
    """|out - fp32 reference| max, and whether every rank got the same bits."""
    total = x.float()
    dist.all_reduce(total)
    h = total + residual.float()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    got = out.float() * (FP8_SCALE if quant else 1.0)
    bits = out.view(torch.uint8).to(torch.int64)
    checksum = torch.stack([bits.sum(), (bits * torch.arange(bits.numel(), device=bits.device)
                                         .view(bits.shape)).sum()])
    gathered = [torch.empty_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    return float((got - want).abs().max()), all(torch.equal(g, gathered[0]) for g in gathered)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", help="comma-separated kernel kinds (default: all)")
    only = parser.parse_args(argv).kernels
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    timer = Timer(device, 3, 20)
    if dist.get_rank() == 0:
        print("| kernel | tokens | fp8 | items per step | num_warps | µs | max abs error | "
              "same bits on all ranks |\n|---|---|---|---|---|---|---|---|")
    for kernel, tokens, quant, group, warps in cases():
        if only and kernel.kind not in only.split(","):
            continue
        x, residual, weight = inputs_for(tokens, HIDDEN, device)
        launch, grid, args, kwargs, results = kernel.bind(
            x, weight=weight, residual=residual, quant=quant,
            tuning=SymmTuning(group_items=group))
        chosen = f"({kwargs['num_warps']})" if warps is None else str(warps)
        kwargs = kwargs if warps is None else dict(kwargs, num_warps=warps)
        us = timer.graph(lambda: launch[grid](*args, **kwargs)) * 1e6
        error, same = error_and_agreement(results[0], x, residual, weight, quant)
        if dist.get_rank() == 0:
            print(f"| {kernel.kind} | {tokens} | {'yes' if quant else ''} | "
                  f"{group or '(layout)'} | {chosen} | {us:.2f} | {error:.3g} | {same} |",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
