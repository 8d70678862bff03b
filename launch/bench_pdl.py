"""Programmatic dependent launch (PDL), A/B: our streamed one-shot (AR + residual add + RMSNorm,
bf16, hidden 4096) and FlashInfer's fused one-shot, each without PDL and with it, timed under
CUDA-graph replay (10 calls a graph, µs per call, max over ranks), each side twice in the order
A, B, B, A. Two settings: the calls back to back (what the sweep times), and each call after a
cuBLAS GEMM that writes its input (what a row-parallel layer runs; the GEMM alone is timed and
taken off). Every call of ours is checked against the fp32 reference and for the same bits on
every rank.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_pdl \\
        [--tokens 1,16,128,1024]

FlashInfer's rows need its module: on the device, `bash .ci/gpu_suite pdl` loads it, then runs this.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from infini_dist.kernels.symm_device import SymmTuning
from infini_dist.launch.arguments import nonempty_ints
from infini_dist.launch.bench import Timer
from infini_dist.launch.bench_eager import inputs_for
from infini_dist.launch.bench_knobs import error_and_agreement
from infini_dist.launch.bench_patterns import EPS, eager_epilogue
from infini_dist.launch.peers_flashinfer import open_peers

HIDDEN = 4096


def ours(x, residual, weight, pdl):
    launch, grid, args, kwargs, results = lamport_one_shot_streamed_all_reduce.bind(
        x, weight=weight, residual=residual, tuning=SymmTuning(pdl=pdl))
    return (lambda: launch[grid](*args, **kwargs)), results


def theirs(flashinfer, x, residual, weight) -> dict:
    """FlashInfer's fused one-shot by PDL (False, True), each checked once against the fp32
    reference (FlashInferPeers.peers); empty without FlashInfer or past its one-shot's buffer."""
    if flashinfer is None:
        return {}
    impls = flashinfer.peers("add_rms_norm", {"x": x, "residual": residual, "weight": weight},
                             lambda y, sides: eager_epilogue("add_rms_norm", y, sides), EPS)
    found = {pdl: impls.get("fi_fused_one_shot" + "_pdl" * pdl) for pdl in (False, True)}
    if not all(found.values()):
        return {}
    return {pdl: run for pdl, (run, _) in found.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=nonempty_ints, default="1,16,128,1024")
    args = parser.parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank0 = dist.get_rank() == 0
    timer = Timer(device, 5, 20, graph_calls=10)
    flashinfer = open_peers(None, max(args.tokens), HIDDEN, torch.bfloat16, device)
    table = []
    for tokens in args.tokens:
        for after_gemm in (False, True):
            x, residual, weight = inputs_for(tokens, HIDDEN, device)
            a = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16) / 8
            w = torch.randn(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16) / 64
            gemm_us = timer.graph(lambda: torch.mm(a, w, out=x)) * 1e6 if after_gemm else 0.0
            means = {}
            fi = theirs(flashinfer, x, residual, weight)
            for who in ("ours", "fi"):
                times = {False: [], True: []}
                for pdl in (False, True, True, False):
                    if who == "ours":
                        call, results = ours(x, residual, weight, pdl)
                    elif not fi:
                        break
                    else:
                        call = fi[pdl]

                    def body(call=call):
                        if after_gemm:
                            torch.mm(a, w, out=x)
                        call()
                    times[pdl].append(timer.graph(body) * 1e6 - gemm_us)
                    if who == "ours":
                        error, same, _ = error_and_agreement(results, x, residual, weight, None)
                        if not same or error > 0.25:
                            raise SystemExit(f"ours, {tokens} tokens, pdl={pdl}: max error "
                                             f"{error:.3g}, same bits on every rank: {same}")
                for pdl, values in times.items():
                    if values:
                        means[(who, pdl)] = sum(values) / len(values)
            table.append((tokens, after_gemm, gemm_us, means))
            if rank0:
                print(f"{tokens} tokens, after a GEMM: {after_gemm}: "
                      + ", ".join(f"{w}{' PDL' if p else ''} {v:.2f}"
                                  for (w, p), v in means.items()), flush=True)
    if rank0:
        nan = float("nan")
        print("\n| tokens | after a GEMM (its µs) | ours | ours, PDL | FlashInfer | "
              "FlashInfer, PDL | FlashInfer / ours, both PDL |\n|---|---|---|---|---|---|---|")
        for tokens, after_gemm, gemm_us, m in table:
            o, op = m[("ours", False)], m[("ours", True)]
            f, fp = m.get(("fi", False), nan), m.get(("fi", True), nan)
            print(f"| {tokens} | {f'yes ({gemm_us:.1f})' if after_gemm else 'no'} | {o:.2f} | "
                  f"{op:.2f} ({op / o:.3f}) | {f:.2f} | {fp:.2f} ({fp / f:.3f}) | {fp / op:.2f} |")
    if flashinfer is not None:
        flashinfer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
