"""How much of an all-reduce's transfer a GEMM running beside it hides, by mechanism, on the
GPUs of one host: the measurement an async site rests on (issue #27: the backward all-reduces
under the weight-gradient GEMMs), and what splitting a GEMM into row chunks costs (issue #26
item 4, `scheduler/backends/symm_chunked.py`).

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_overlap [--tokens 2048]

bf16, hidden 4096, the TP decoder's GEMMs at TP = W (Llama-3-8B widths), every row under
CUDA-graph replay, µs per call, max over ranks:
  gemm NAME            the GEMM alone (cuBLAS)
  gemm NAME / C        the same GEMM as C matmuls over row chunks, nothing else running
  gemm NAME, ...       the forward GEMMs storing their output (or half its rows) into a
                       peer's symmetric memory: the transfer made by the GEMM's own stores;
                       also rank 0's alone (one direction busy: the sender's cost or the link's)
  NAME: gemm_one_shot  our Triton GEMM pushing its tiles, then the reduction + add + RMSNorm
                       (kernels/gemm_all_reduce), together and each launch apart
  TRANSFER             the all-reduce's transfer alone: `ce_push` (a copy engine writing this
                       rank's tokens x 4096 into every peer's symmetric buffer), `nccl_ar`,
                       `streamed` / `streamed_pP` (one_shot_lamport_streamed, AR + add +
                       RMSNorm, on its own grid or on P programs)
  TRANSFER | gemm NAME the transfer started first on a side stream, the GEMM on the caller's
                       stream, then joined; hidden = (gemm + transfer - pair) / transfer
Every transfer's result is checked after its pair ran: the copies on their receivers, the
streamed kernel against the fp32 reference and for the same bits on every rank.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist

from infini_dist.launch.arguments import positive_int
from infini_dist.launch.bench_knobs import error_and_agreement
from infini_dist.launch.bench_link import (HIDDEN, Link, add_probe_arguments, source,
                                           start_probe)

MLP, HEADS, KV_HEADS, HEAD_DIM = 14336, 32, 8, 128


def gemms(tokens: int, world: int, device) -> dict:
    """name -> (a, b): the decoder's forward row-parallel GEMMs (x @ w.T, whose output is the
    all-reduce's input) and the backward weight-gradient GEMMs (dy.T @ x) that an input
    gradient's all-reduce could run under."""
    seeds = itertools.count(300)

    def randn(*shape):
        return source(next(seeds), shape[0] * shape[1], device).view(shape)
    mlp, qkv = MLP // world, (HEADS + 2 * KV_HEADS) * HEAD_DIM // world
    o_in = HEADS * HEAD_DIM // world
    return {"down (fwd)": (randn(tokens, mlp), randn(HIDDEN, mlp).t()),
            "o_proj (fwd)": (randn(tokens, o_in), randn(HIDDEN, o_in).t()),
            "dW gate_up": (randn(tokens, 2 * mlp).t(), randn(tokens, HIDDEN)),
            "dW qkv": (randn(tokens, qkv).t(), randn(tokens, HIDDEN))}


def in_chunks(a, b, chunks: int):
    """(out, run): run computes a @ b into out as `chunks` matmuls over row chunks."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    bounds = torch.linspace(0, a.shape[0], chunks + 1).round().long().tolist()

    def run():
        for start, end in zip(bounds, bounds[1:]):
            torch.mm(a[start:end], b, out=out[start:end])
    return out, run


def beside(transfer, gemm, side: torch.cuda.Stream):
    """The transfer first, on `side`, the GEMM on the caller's stream, then joined."""
    def run():
        caller = torch.cuda.current_stream()
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            transfer()
        gemm()
        caller.wait_stream(side)
    return run


def transfers(link: Link, tokens: int, group):
    """name -> (callable, check): check(run) clears the transfer's result, calls run (the
    transfer alone or beside a GEMM) once and says whether the result is right."""
    from infini_dist.kernels.lamport_one_shot_streamed import (
        lamport_one_shot_streamed_all_reduce)
    device = link.device
    x = link.mine.view(tokens, HIDDEN)
    residual = source(100, x.numel(), device).view(tokens, HIDDEN)  # replicated, as in TP
    weight = source(200, HIDDEN, device)
    launch, grid, args, kwargs, results = lamport_one_shot_streamed_all_reduce.bind(
        x, residual=residual, weight=weight, group=group)
    data = x.clone()

    def streamed_ok(run):
        results[0].fill_(0.0)
        run()
        error, same = error_and_agreement(results, x, residual, weight, None)[:2]
        return f"max abs error {error:.3g}, " + ("same bits" if same else "RANKS DIFFER")

    def ce_ok(run):
        link.clear()
        torch.cuda.synchronize(device)
        dist.barrier()  # every receiver cleared before any sender copies
        run()
        return "received" if link.received(pulled=False) else "WRONG DATA"
    rows = {"ce_push": (link.ce_push, ce_ok),
            "nccl_ar": (lambda: dist.all_reduce(data, group=group), lambda run: "")}
    for programs in (None, 32):
        name = "streamed" if programs is None else f"streamed_p{programs}"
        programs = grid[0] if programs is None else min(grid[0], programs)
        rows[name] = ((lambda p=programs: launch[(p,)](*args, **kwargs)), streamed_ok)
    return rows


def into_peer(link: Link, a, b) -> dict:
    """label -> run: the GEMM with its output rows in the first peer's symmetric memory (cuBLAS
    storing over the link), all of them, or the first half there and the rest here: a
    reduce-scatter made by the GEMM's own stores, at two ranks."""
    rows, half = a.shape[0], a.shape[0] // 2
    peer = link.remote(link.peers[0], link.rank)[:rows * b.shape[1]].view(rows, b.shape[1])
    here = link.own()[:rows * b.shape[1]].view(rows, b.shape[1])

    def halves():
        torch.mm(a[:half], b, out=peer[:half])
        torch.mm(a[half:], b, out=here[half:])
    first = peer if link.rank == 0 else here  # whether the sender or the link pays
    return {"out in a peer's memory": lambda: torch.mm(a, b, out=peer),
            "half the rows in a peer's memory, then half here": halves,
            "rank 0's out in a peer's memory, the others' here": lambda: torch.mm(
                a, b, out=first)}


def gemm_one_shot_parts(a, b, group, device) -> tuple[dict, object]:
    """(label -> run, check): kernels/gemm_all_reduce's two launches for a @ b with the
    all-reduce + residual add + RMSNorm, together and apart, and its first launch with its
    pushes landing in this GPU's own memory (local scratch): what the pushes over the link cost
    our GEMM, beside what cuBLAS storing into a peer costs (`into_peer`)."""
    from infini_dist.kernels import symm_buffers
    from infini_dist.kernels.gemm_all_reduce import KIND, gemm_all_reduce_launch, gemm_bytes
    from infini_dist.kernels.symm_call import norm_options
    rows, n = a.shape[0], b.shape[1]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = gemm_bytes(rows * n, a.element_size(), world)
    out, pre = (torch.empty(rows, n, dtype=a.dtype, device=device) for _ in range(2))
    residual = source(100, rows * n, device).view(rows, n)
    weight = source(200, n, device)
    options = dict(pre=pre, **norm_options(out, "rms_norm", weight, None, residual))
    w = b.t()  # [N, K]: F.linear's layout
    (gemm, reduce), (local_gemm, _) = (
        gemm_all_reduce_launch(a, w, buffer, out, **options)
        for buffer in (symm_buffers.get_buffer(group, device, KIND, size),
                       symm_buffers.local_scratch(world, rank, size, device)))

    def launch(*launches):
        def run():
            for kernel, grid, args, kwargs in launches:
                kernel[grid](*args, **kwargs)
        return run

    def check(run):
        out.fill_(0.0)
        run()
        error, same = error_and_agreement((out,), a @ b, residual, weight, None)[:2]
        return f"max abs error {error:.3g}, " + ("same bits" if same else "RANKS DIFFER")
    return {"gemm_one_shot: GEMM + push, then reduction + add + RMSNorm": launch(gemm, reduce),
            "its GEMM + push to the peers alone": launch(gemm),
            "its GEMM + push into local scratch": launch(local_gemm),
            "its reduction + add + RMSNorm alone": launch(reduce)}, check


def received_gemm(link: Link, a, b, run) -> str:
    """Every rank's GEMM operands are the same (`gemms`), so what the peer stored into this
    rank's slot must be this rank's own product, bit for bit."""
    link.clear()
    torch.cuda.synchronize(link.device)
    dist.barrier()
    run()
    torch.cuda.synchronize(link.device)
    dist.barrier()
    sender = (link.rank - 1) % link.world  # whose link.peers[0] this rank is
    got = link.symm[sender * link.numel:][:a.shape[0] * b.shape[1]].view(a.shape[0], b.shape[1])
    rows = a.shape[0] if torch.count_nonzero(got[a.shape[0] // 2:]) else a.shape[0] // 2
    ok = torch.tensor([int(torch.equal(got[:rows], (a @ b)[:rows]))], device=link.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return "received" if ok.item() else "WRONG DATA"


def table(rows: list[tuple]) -> str:
    lines = ["| row | µs | gemm + transfer alone | hidden | check |", "|---|---|---|---|---|"]
    for name, us, alone, hidden, check in rows:
        lines.append(f"| {name} | {us:.1f} | {alone} | {hidden} | {check} |")
    return "\n".join(lines)


def sweep(tokens: int, group, device, timer) -> list[tuple]:
    rank0 = dist.get_rank() == 0
    rows = []

    def add(name, us, alone="", hidden="", check=""):
        rows.append((name, us, alone, hidden, check))
        if rank0:
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    alone = {}
    operands = gemms(tokens, dist.get_world_size(group), device)
    for name, (a, b) in operands.items():
        alone[name] = timer.graph(lambda a=a, b=b: a @ b) * 1e6
        add(f"gemm {name}", alone[name])
        if name.endswith("(fwd)"):
            for chunks in (2, 4):
                add(f"gemm {name} / {chunks}", timer.graph(in_chunks(a, b, chunks)[1]) * 1e6)
    link = Link(tokens * HIDDEN, group, device)
    for name, (a, b) in operands.items():
        if name.endswith("(fwd)"):
            for label, run in into_peer(link, a, b).items():
                add(f"gemm {name}, {label}", timer.graph(run) * 1e6,
                    check="" if label.startswith("rank 0") else received_gemm(link, a, b, run))
                link.own().copy_(link.mine)  # `here` wrote over this rank's data
            parts, check = gemm_one_shot_parts(a, b, group, device)
            for label, run in parts.items():
                add(f"{name}: {label}", timer.graph(run) * 1e6,
                    check=check(run) if label.startswith("gemm_one_shot") else "")
    side = torch.cuda.Stream(device)
    for t_name, (transfer, check) in transfers(link, tokens, group).items():
        t_alone = timer.graph(transfer) * 1e6
        add(t_name, t_alone, check=check(transfer))
        for g_name, (a, b) in operands.items():
            run = beside(transfer, lambda a=a, b=b: a @ b, side)
            pair = timer.graph(run) * 1e6
            hidden = (alone[g_name] + t_alone - pair) / t_alone
            add(f"{t_name} \\| gemm {g_name}", pair, f"{alone[g_name] + t_alone:.1f}",
                f"{hidden:.0%}", check(run))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=2048)
    add_probe_arguments(parser, watchdog=150)
    args = parser.parse_args(argv)
    device, timer = start_probe(args)
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name(device)} x {dist.get_world_size()}, "
              f"{args.tokens} tokens", flush=True)
    rows = sweep(args.tokens, dist.group.WORLD, device, timer)
    if dist.get_rank() == 0:
        print(table(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
