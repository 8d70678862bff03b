"""The symmetric-memory kernels' launch knobs, swept: num_warps, and the two-shot kernels' items
per step (`SymmTuning(group_items=)`), each variant checked against the fp32 reference and for
bitwise identical outputs on every rank, then timed under CUDA-graph replay (µs per call, max
over ranks). For kernel work: the engine does not tune these knobs, the layouts pick them.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_knobs [--kernels K,..]

AR + residual add + RMSNorm, bf16, hidden 4096: one_shot_lamport at 1 / 16 / 128 tokens (with
and without static FP8), two_shot_polled_gather and two_shot at 1024 / 8192 tokens,
one_shot_lamport_streamed at 1 to 8192 tokens. `--kernels`: only these kernels (by kind).

`--pairs`: instead, A/B pairs of one kernel's knobs, 10 calls a graph as the sweep times them,
each pair timed twice in alternating order, a summary table last: the two Lamport one-shot
kernels with per-token FP8's row max from a pass of its own and from the norm's reduction
(`SymmTuning(fold_row_max=)`, which must give the same bits), the streamed one with one and two
items a step from 1024 tokens (without FP8, static and per-token), and with its 16 warps or 4
or 8 at 1-128 tokens (without FP8 and per-token: fewer warps, cheaper row reductions), and
the two-shot with an FP8 output at 2048 and 8192 tokens, the launch's 4 rows a step against 2
(4 rows spill registers in the sm_90 code, yet were 3-5% faster on 2 H100s; session 27).
(Session 17's pairs of `SymmTuning(preload=)` decided that knob: docs/notes_symm.md.)

`--fp8-pairs`: the FP8 quantizers' cost, A/B pairs of the streamed kernel without a quantizer
and with one (a float scale, a checkpoint's one-element scale tensor, per-token scales), 1 to
8192 tokens.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from infini_dist.kernels.lamport_one_shot import lamport_one_shot_all_reduce
from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning
from infini_dist.kernels.two_shot_all_reduce import two_shot_all_reduce
from infini_dist.kernels.two_shot_polled_gather import two_shot_polled_gather_all_reduce
from infini_dist.launch.bench import Timer
from infini_dist.launch.bench_eager import inputs_for

HIDDEN, FP8_SCALE = 4096, 0.05
PER_TOKEN = ("quant_fp8_per_token",)
STATIC = ("quant_fp8", FP8_SCALE)


def cases():
    for tokens in (1, 16, 128):
        for quant in (None, STATIC):
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


def pairs():
    """(kernel, tokens, what differs, A, B), each side (quant, tuning, num_warps or None for
    the launch's)."""
    streamed, lamport = lamport_one_shot_streamed_all_reduce, lamport_one_shot_all_reduce
    for tokens in (1, 16, 128, 1024, 8192):
        yield streamed, tokens, "row max", (PER_TOKEN, SymmTuning(fold_row_max=False), None), \
            (PER_TOKEN, DEFAULT_TUNING, None)
    for tokens in (1, 16, 128):
        yield lamport, tokens, "row max", (PER_TOKEN, SymmTuning(fold_row_max=False), None), \
            (PER_TOKEN, DEFAULT_TUNING, None)
    for tokens in (1024, 2048, 4096, 8192):
        for quant in (None, STATIC, PER_TOKEN):
            yield streamed, tokens, "items a step", (quant, SymmTuning(group_items=1), None), \
                (quant, SymmTuning(group_items=2), None)
    for tokens in (1, 16, 128):
        for quant in (None, PER_TOKEN):
            for warps in (4, 8):
                yield streamed, tokens, f"warps {warps}", (quant, DEFAULT_TUNING, None), \
                    (quant, DEFAULT_TUNING, warps)
    for tokens in (2048, 8192):  # the launch's 4 rows a step with FP8, which spill registers
        for quant in (STATIC, PER_TOKEN):
            yield two_shot_all_reduce, tokens, "FP8 rows a step", \
                (quant, DEFAULT_TUNING, None), (quant, SymmTuning(group_items=2), None)


def fp8_pairs(device):
    """Issue #25's FP8 cost as A/B pairs: the streamed kernel (the engine's commit on 2 ranks)
    without a quantizer and with each: a float scale, a one-element tensor scale (an FP8
    checkpoint's, read by the kernel) and per-token scales."""
    held = ("quant_fp8_tensor_scale", torch.tensor([FP8_SCALE], device=device))
    for tokens in (1, 16, 128, 1024, 8192):
        for name, quant in (("static", STATIC), ("tensor", held), ("per-token", PER_TOKEN)):
            yield lamport_one_shot_streamed_all_reduce, tokens, f"fp8 {name}", \
                (None, DEFAULT_TUNING, None), (quant, DEFAULT_TUNING, None)


def error_and_agreement(results, x, residual, weight, quant) -> tuple[float, bool, list]:
    """|out - fp32 reference| max, whether every rank got the same bits, and their checksum."""
    out = results[0]
    total = x.float()
    dist.all_reduce(total)
    h = total + residual.float()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    scale = results[1] if quant == PER_TOKEN else FP8_SCALE if quant else 1.0  # float or tensor
    got = out.float() * scale
    same, checksum = bits_agree(out)
    return float((got - want).abs().max()), same, checksum


def bits_agree(out) -> tuple[bool, list]:
    """Whether every rank holds the same bits in `out` (contiguous), and this rank's checksum."""
    bits = out.view(torch.uint8).to(torch.int64)
    checksum = torch.stack([bits.sum(), (bits * torch.arange(bits.numel(), device=bits.device)
                                         .view(bits.shape)).sum()])
    gathered = [torch.empty_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    return all(torch.equal(g, gathered[0]) for g in gathered), checksum.tolist()


def pair_sweep(device, cases, legend):
    timer = Timer(device, 5, 20, graph_calls=10)
    rank0 = dist.get_rank() == 0
    if rank0:
        print("| kernel | tokens | knob | A or B | quant | µs | max abs error | same bits |\n"
              "|---|---|---|---|---|---|---|---|")
    differing = []  # row-max pairs whose two sides gave other bits: they must not
    summary = []
    for kernel, tokens, knob, *sides in cases:
        x, residual, weight = inputs_for(tokens, HIDDEN, device)
        times, sums = ([], []), ([], [])
        for side in (0, 1, 1, 0):  # alternating: drift falls on both
            quant, tuning, warps = sides[side]
            launch, grid, args, kwargs, results = kernel.bind(
                x, weight=weight, residual=residual, quant=quant, tuning=tuning)
            kwargs = kwargs if warps is None else dict(kwargs, num_warps=warps)
            us = timer.graph(lambda: launch[grid](*args, **kwargs)) * 1e6
            error, same, checksum = error_and_agreement(results, x, residual, weight, quant)
            if not same:
                raise SystemExit(f"{kernel.kind}, {tokens} tokens, {knob} {'AB'[side]}: "
                                 "other bits on another rank")
            times[side].append(us)
            sums[side].append(checksum)
            if rank0:
                print(f"| {kernel.kind} | {tokens} | {knob} | {'AB'[side]} | "
                      f"{quant[0] if quant else ''} | {us:.2f} | {error:.3g} | {same} |",
                      flush=True)
        summary.append((kernel.kind, tokens, knob, sides[0][0], *(sum(t) / 2 for t in times)))
        if knob == "row max" and sums[0] != sums[1]:
            differing.append((kernel.kind, tokens))
    if rank0:
        print(f"\nrow-max pairs with other bits on the two sides: {differing or 'none'}")
        print(f"\nA / B: {legend}\n| kernel | tokens | A's quant | knob | A µs | B µs | B / A |\n"
              "|---|---|---|---|---|---|---|")
        for kind, tokens, knob, quant, a, b in summary:
            print(f"| {kind} | {tokens} | {quant[0] if quant else ''} | {knob} | {a:.2f} | "
                  f"{b:.2f} | {b / a:.3f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", help="comma-separated kernel kinds (default: all)")
    parser.add_argument("--pairs", action="store_true",
                        help="the A/B pairs instead (the module's docstring)")
    parser.add_argument("--fp8-pairs", action="store_true",
                        help="the FP8 quantizers' cost as A/B pairs instead")
    options = parser.parse_args(argv)
    only = options.kernels
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    if options.pairs or options.fp8_pairs:
        if options.fp8_pairs:
            pair_sweep(device, fp8_pairs(device), "no quantizer / the quantizer")
        if options.pairs:
            pair_sweep(device, pairs(), "row max by its own pass / from the norm; items a "
                       "step 1 / 2; warps the launch's / 4 or 8")
        dist.destroy_process_group()
        return
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
        error, same, _ = error_and_agreement(results, x, residual, weight, quant)
        if dist.get_rank() == 0:
            print(f"| {kernel.kind} | {tokens} | {'yes' if quant else ''} | "
                  f"{group or '(layout)'} | {chosen} | {us:.2f} | {error:.3g} | {same} |",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
