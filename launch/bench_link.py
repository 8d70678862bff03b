"""The link's practical floor: how fast bytes cross between the GPUs with no arithmetic at all,
by every mechanism a kernel could use, beside our fused all-reduce at the same sizes.

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_link [--mib 1,8,64]

Issue #25 states its large-size targets against NV18's nominal ~450 GB/s a direction. What the
link delivers in practice decides how far any all-reduce can go, so every rank sends at once
(an all-reduce's traffic: both directions busy) and each row is timed under CUDA-graph replay,
µs per call, max over ranks:
  ce_push / ce_pull    a copy engine (cudaMemcpyAsync, torch's copy_ of contiguous tensors)
                       writing into every peer's symmetric buffer / reading from it
  ce_push_split<k>     the same bytes as k copies on k streams (several copy engines)
  sm_push / sm_pull    a Triton kernel storing into / loading from every peer's buffer
                       (<programs>x<warps>)
  nccl_sendrecv        NCCL send + recv of the same bytes with every peer (--sendrecv)
  nccl_ar, symm_two_shot_ar   the all-reduces alone, S bytes
  ours                 one_shot_lamport_streamed: all-reduce + residual add + RMSNorm, checked
                       against the fp32 reference and for the same bits on every rank
GB/s is the bytes a rank sends a direction (S to each peer) over the time. Every copy is checked
on its receiver against the sender's data. Rows print as they are measured, the table
last.
"""

from __future__ import annotations

import argparse
import faulthandler
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from infini_dist.launch.arguments import positive_int, positive_ints
from infini_dist.launch.bench import Timer
from infini_dist.launch.bench_knobs import error_and_agreement

HIDDEN = 4096  # bf16 rows: 1 MiB = 128 tokens, 8 MiB = 1024, 64 MiB = 8192


@triton.jit
def _copy_kernel(src, dst, numel, BLOCK: tl.constexpr):
    start, stride = tl.program_id(0) * BLOCK, tl.num_programs(0) * BLOCK
    for offset in range(start, numel, stride):
        index = offset + tl.arange(0, BLOCK)
        mask = index < numel
        tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)


def source(rank: int, numel: int, device) -> torch.Tensor:
    """Rank `rank`'s data: the same values wherever it is made, never zeros."""
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    return torch.randn(numel, generator=generator, device=device, dtype=torch.float32).to(
        torch.bfloat16)


def gbps(size_bytes: int, seconds: float) -> float:
    """Bytes one rank sends a direction (S to each peer) per second, in GB/s."""
    return size_bytes / seconds / 1e9


class Link:
    """One size's buffers: symmetric slots 0..W-1 take the peers' pushes (slot r: rank r's),
    slot W holds this rank's own data, which pulls read."""

    def __init__(self, numel: int, group, device):
        import torch.distributed._symmetric_memory as symm_mem
        self.numel, self.device = numel, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.peers = [(self.rank + step) % self.world for step in range(1, self.world)]
        self.symm = symm_mem.empty((self.world + 1) * numel, dtype=torch.bfloat16, device=device)
        self.handle = symm_mem.rendezvous(self.symm, group.group_name)
        self.mine = source(self.rank, numel, device)
        self.symm[self.world * numel:].copy_(self.mine)
        self.pulled = torch.empty(self.world * numel, dtype=torch.bfloat16, device=device)
        self.streams = [torch.cuda.Stream(device) for _ in range(4)]

    def remote(self, peer: int, slot: int) -> torch.Tensor:
        return self.handle.get_buffer(peer, (self.numel,), torch.bfloat16,
                                      storage_offset=slot * self.numel)

    def own(self) -> torch.Tensor:
        return self.symm[self.world * self.numel:]

    def ce_push(self):
        for peer in self.peers:
            self.remote(peer, self.rank).copy_(self.own())

    def ce_pull(self):
        for peer in self.peers:
            self.pulled[peer * self.numel:(peer + 1) * self.numel].copy_(
                self.remote(peer, self.world))

    def ce_push_split(self, parts: int):
        current = torch.cuda.current_stream(self.device)
        chunk = triton.cdiv(self.numel, parts)
        for stream in self.streams[:parts]:
            stream.wait_stream(current)
        for index, stream in enumerate(self.streams[:parts]):
            with torch.cuda.stream(stream):
                for peer in self.peers:
                    self.remote(peer, self.rank)[index * chunk:(index + 1) * chunk].copy_(
                        self.own()[index * chunk:(index + 1) * chunk])
        for stream in self.streams[:parts]:
            current.wait_stream(stream)

    def sm(self, push: bool, programs: int, warps: int, block: int = 8192):
        for peer in self.peers:
            if push:
                src, dst = self.own(), self.remote(peer, self.rank)
            else:
                src = self.remote(peer, self.world)
                dst = self.pulled[peer * self.numel:(peer + 1) * self.numel]
            _copy_kernel[(programs,)](src, dst, self.numel, BLOCK=block, num_warps=warps)

    def clear(self):
        self.symm[:self.world * self.numel].fill_(0.0)
        self.pulled.fill_(0.0)

    def received(self, pulled: bool) -> bool:
        """Whether every peer's data arrived intact on every rank (pushed into its slots, or
        pulled)."""
        torch.cuda.synchronize(self.device)
        dist.barrier()
        ok = True
        for peer in self.peers:
            got = (self.pulled[peer * self.numel:(peer + 1) * self.numel] if pulled
                   else self.symm[peer * self.numel:(peer + 1) * self.numel])
            ok = ok and torch.equal(got, source(peer, self.numel, self.device))
        everywhere = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
        return bool(everywhere.item())


def nccl_sendrecv(link: Link, group):
    ops = []
    for peer in link.peers:
        ops.append(dist.P2POp(dist.isend, link.own(), peer, group))
        ops.append(dist.P2POp(dist.irecv, link.pulled[peer * link.numel:(peer + 1) * link.numel],
                              peer, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_reduce_rows(link: Link, group, timer: Timer) -> list[tuple]:
    """The all-reduces at the same size: NCCL alone, torch's symmetric two-shot alone, ours
    fused (+ add + RMSNorm), each as (name, seconds, check)."""
    from infini_dist.kernels.lamport_one_shot_streamed import (
        lamport_one_shot_streamed_all_reduce)
    rows = []
    data = link.mine.clone()
    rows.append(("nccl_ar", timer.graph(lambda: dist.all_reduce(data, group=group)), ""))
    import torch.distributed._symmetric_memory as symm_mem
    symm = symm_mem.empty(link.numel, dtype=torch.bfloat16, device=link.device)
    symm_mem.rendezvous(symm, group.group_name)
    symm.copy_(link.mine)
    rows.append(("symm_two_shot_ar", timer.graph(
        lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group.group_name)), ""))
    x = link.mine.view(-1, HIDDEN)
    # replicated, as a TP layer's residual stream is: then every rank's output has the same bits
    residual = source(100, link.numel, link.device).view(-1, HIDDEN)
    weight = source(200, HIDDEN, link.device)
    launch, grid, args, kwargs, results = lamport_one_shot_streamed_all_reduce.bind(
        x, residual=residual, weight=weight, group=group)
    seconds = timer.graph(lambda: launch[grid](*args, **kwargs))
    error, same, _ = error_and_agreement(results, x, residual, weight, None)
    rows.append(("ours (AR + add + RMSNorm)", seconds,
                 f"max abs error {error:.3g}, " + ("same bits on all ranks" if same
                                                  else "RANKS DIFFER")))
    return rows


def report(row: dict) -> dict:
    """`row`, printed at once by rank 0 (a run cut short still shows what it measured)."""
    if dist.get_rank() == 0:
        print(table([row]).splitlines()[-1], flush=True)
    return row


def sweep(mib: int, group, device, timer: Timer, sendrecv: bool) -> list[dict]:
    link = Link(mib * 2 ** 19, group, device)
    size = link.numel * 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    variants = [("ce_push", link.ce_push, False), ("ce_pull", link.ce_pull, True)]
    variants += [(f"ce_push_split{k}", lambda k=k: link.ce_push_split(k), False) for k in (2, 4)]
    for push in (True, False):
        for programs, warps in ((sms, 8), (sms, 16), (2 * sms, 8), (4 * sms, 8)):
            variants.append((f"sm_{'push' if push else 'pull'} {programs}x{warps}",
                             lambda p=push, g=programs, w=warps: link.sm(p, g, w), not push))
    rows = []
    for name, fn, pulled in variants:
        if dist.get_rank() == 0:
            print(f"-- {mib} MiB {name}", flush=True)
        link.clear()
        try:
            seconds = timer.graph(fn)
        except Exception as error:  # noqa: BLE001 - one mechanism failing must not stop the rest
            torch.cuda.synchronize(device)
            rows.append(report(dict(mib=mib, name=name,
                                    error=f"{type(error).__name__}: {error}"[:200])))
            continue
        check = "received" if link.received(pulled) else "WRONG DATA"
        rows.append(report(dict(mib=mib, name=name, us=seconds * 1e6,
                                gbps=gbps(size, seconds), check=check)))
    for name, seconds, check in all_reduce_rows(link, group, timer):
        rows.append(report(dict(mib=mib, name=name, us=seconds * 1e6,
                                gbps=gbps(size, seconds), check=check)))
    if sendrecv:
        seconds = timer.graph(lambda: nccl_sendrecv(link, group))
        check = "received" if link.received(True) else "WRONG DATA"
        rows.append(report(dict(mib=mib, name="nccl_sendrecv", us=seconds * 1e6,
                                gbps=gbps(size, seconds), check=check)))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| MiB | mechanism | µs | GB/s a direction | check |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['mib']} | {row['name']} | | | {row['error']} |")
            continue
        lines.append(f"| {row['mib']} | {row['name']} | {row['us']:.1f} | {row['gbps']:.0f} | "
                     f"{row['check']} |")
    return "\n".join(lines)


def add_probe_arguments(parser, watchdog: int) -> None:
    """The timing and watchdog flags of the probes on this host's GPUs (this one, bench_overlap)."""
    parser.add_argument("--trials", type=positive_int, default=5)
    parser.add_argument("--replays", type=positive_int, default=20)
    parser.add_argument("--watchdog", type=positive_int, default=watchdog,
                        help="seconds before every thread's stack is dumped and the rank exits")


def start_probe(args) -> tuple:
    """(device, Timer) of this torchrun rank, its NCCL group up and the watchdog armed."""
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device, Timer(device, args.trials, args.replays)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=positive_ints, default=[1, 8, 64],
                        help="tensor sizes in MiB (bf16 rows of 4096: 1 MiB = 128 tokens)")
    parser.add_argument("--sendrecv", action="store_true", help="NCCL send + recv too, last")
    add_probe_arguments(parser, watchdog=110)
    args = parser.parse_args(argv)
    device, timer = start_probe(args)
    group = dist.group.WORLD
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name(device)} x {dist.get_world_size()}", flush=True)
    rows = []
    for mib in args.mib:
        rows += sweep(mib, group, device, timer, args.sendrecv)
    if dist.get_rank() == 0:
        print(table(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
