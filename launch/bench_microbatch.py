"""What two micro-batches pipelined across the TP decoder's layers, or each site split into a
reduce-scatter and an all-gather under the GEMMs beside it, hide of its all-reduces: the
measurement that decides whether a pass making either is worth building (issue #26 item 4:
prefill ≤ 1.05× the collective-free step; #27's forward sites).

    torchrun --standalone --nproc-per-node=2 -m infini_dist.launch.bench_microbatch \
        [--tokens 2048] [--layers 4] [--rounds 3] [--variants floor,sync,...] [--trace DIR]

A prefill of two sequences of tokens / 2 through `launch/tp_decoder.py`'s layers (Llama-3-8B
widths, random weights, bf16), forward only, the whole forward in one CUDA graph, ms per
forward, max over ranks, seven ways:
  floor      every site's all_reduce a no-op: the reduction kernel over this rank's rows alone,
             with the residual add and the RMSNorm (the collective-free step's sites)
  sync       every site `one_shot_lamport_streamed` (all-reduce + add + RMSNorm) over both
             sequences at once: what the pass commits at prefill today
  floor_microbatched   the floor's sites, the sequences as two micro-batches in `schedule`'s
             order: what splitting the batch costs the GEMMs and the attention
  pipelined  the sequences as two micro-batches, interleaved (`schedule`): a site's GEMM writes
             into this rank's slot of a symmetric buffer, a copy engine pushes it into every
             peer's on a side stream, and the other micro-batch's next GEMMs run before the
             site's reduction (kernels/chunk_reduce.py: barrier, sum in rank order + add +
             RMSNorm, barrier). A copy beside a GEMM was 84-98% hidden (bench_overlap).
  rs_ag, floor_rs_ag   the whole batch, each site a reduce-scatter and an all-gather by copy
             engine under the GEMMs beside it, and its floor (launch/row_split.py).
  rs_ag_spin the same, each barrier replaced by flags the copy stream sets and a kernel polls.
The rounds run the variants in turns, every other round in reverse order (the clocks drift over
a run); "/ floor" is the median over rounds of each round's ratio. Every variant's output is
compared with an fp32-accumulated NCCL reference of the same layers (relative L2), and its bits
across ranks. --trace writes one forward's kernels and copies per rank; the ranks' replays do
not start together, so the first barrier of the rank that starts first holds that wait.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.chunk_reduce import chunk_reduce_bytes, chunk_reduce_launches
from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.symm_call import norm_options
from infini_dist.launch.arguments import positive_int
from infini_dist.launch.bench_knobs import bits_agree
from infini_dist.launch.bench_link import add_probe_arguments, start_probe
from infini_dist.launch.row_split import NAMES as ROW_SPLITS
from infini_dist.launch.row_split import RowSplit, attention_core, launch, mlp_core
from infini_dist.launch.tp_decoder import Decoder, ModelConfig, rms_norm

MICROBATCHES = 2
VARIANTS = ("floor", "floor_microbatched", "sync", "pipelined")


def schedule(stages: int, microbatches: int = MICROBATCHES) -> list[tuple[str, int, int]]:
    """The pipelined order: ("compute", mb, k) runs micro-batch mb's stage k (its attention or
    MLP, ending in the GEMM whose output is copied out), ("site", mb, k) that stage's reduction.
    A micro-batch's site k comes right before its compute k + 1, so between its copy and its
    reduction the other micro-batches' computes run."""
    order, pending = [], [None] * microbatches
    for k in range(stages):
        for mb in range(microbatches):
            if pending[mb] is not None:
                order.append(("site", mb, pending[mb]))
            order.append(("compute", mb, k))
            pending[mb] = k
    order += [("site", mb, k) for mb, k in enumerate(pending)]
    return order


def attention_into(layer, h, out):
    """tp_decoder.Layer.attention (causal prefill) with the o_proj GEMM written into `out`."""
    torch.mm(attention_core(layer, F.linear(h, layer.wqkv)), layer.wo.t(), out=out)


def mlp_into(layer, h, out):
    core = mlp_core(layer, F.linear(h, layer.w_gate_up))
    torch.mm(core.reshape(out.shape[0], -1), layer.w_down.t(), out=out)


def stage_norms(model) -> list:
    """The norm weight after each stage: mlp_norm after attention, the next layer's attn_norm
    (the final norm last) after the MLP."""
    layers = model.layers
    return [w for i, layer in enumerate(layers) for w in (
        layer.mlp_norm, layers[i + 1].attn_norm if i + 1 < len(layers) else model.final_norm)]


def compute_into(model, k, h, out):
    layer = model.layers[k // 2]
    (attention_into if k % 2 == 0 else mlp_into)(layer, h, out)


class Stages:
    """One micro-batch's forward (or the whole batch's), bound: per stage k, the GEMM's output
    `ys[k]` (where its site reads it) and the site's launches, which write the next stage's
    input `h[k + 1]` and residual."""

    def __init__(self, model, x, ys, sites):
        """sites[k](y, residual, weight) -> (launches, out, pre): stage k's site."""
        self.model, self.x, self.ys = model, x, ys
        rows = x.shape[0] * x.shape[1]
        self.h = [torch.empty_like(x)]
        residual = x.view(rows, -1)
        self.launch_lists = []
        for k, (site, weight) in enumerate(zip(sites, stage_norms(model))):
            launches, out, residual = site(ys[k], residual, weight)
            self.launch_lists.append(launches)
            self.h.append(out.view(x.shape))

    def first_norm(self):
        self.h[0].copy_(rms_norm(self.x, self.model.layers[0].attn_norm, self.model.cfg.eps))

    def compute(self, k):
        compute_into(self.model, k, self.h[k], self.ys[k])

    def site(self, k):
        for kernel_launch in self.launch_lists[k]:
            launch(kernel_launch)


def reduce_site(buffer, barriers=True):
    """kernels/chunk_reduce.py's launches: [barrier,] reduction + add + RMSNorm[, barrier]."""
    def site(y, residual, weight):
        out, pre = torch.empty_like(y), torch.empty_like(y)
        launches = chunk_reduce_launches(y, buffer, out, [(0, y.numel())], pre=pre,
                                         **norm_options(y, "rms_norm", weight, None, residual))
        return (launches[0] if barriers else launches[0][1:2]), out, pre
    return site


def streamed_site(group):
    def site(y, residual, weight):
        kernel, grid, args, kwargs, (out, pre) = lamport_one_shot_streamed_all_reduce.bind(
            y, residual=residual, weight=weight, group=group)
        return [(kernel, grid, args, kwargs)], out, pre
    return site


class Variant:
    """A bound forward of the whole batch (`floor`, `sync`) or of its micro-batches
    (`floor_microbatched`, `pipelined`); calling it runs one forward and returns the last
    norm's output."""

    def __init__(self, name, model, x, group, device):
        self.name = name
        stages = 2 * len(model.layers)
        rows, hidden = x.shape[0] * x.shape[1], x.shape[2]
        if name != "pipelined":
            split = name == "floor_microbatched"
            parts = [x[i:i + 1] for i in range(MICROBATCHES)] if split else [x]
            per = rows // len(parts)
            local = reduce_site(symm_buffers.local_scratch(
                1, 0, chunk_reduce_bytes(per * hidden, x.element_size(), 1), device),
                barriers=False)
            site = streamed_site(group) if name == "sync" else local
            self.parts = [Stages(model, part, [torch.empty(per, hidden, dtype=x.dtype,
                                                           device=device)
                                               for _ in range(stages)], [site] * stages)
                          for part in parts]
            return
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        numel = rows // MICROBATCHES * hidden
        at = rank * slot_elements(numel)
        self.copy_stream = torch.cuda.Stream(device)
        self.parts, self.targets = [], []
        for mb in range(MICROBATCHES):
            # a buffer per micro-batch and site kind, reused layer after layer: the site's
            # closing barrier frees it for the next layer's copies
            buffers = [symm_buffers.get_buffer(group, device, f"microbatch{mb}_{kind}",
                                               chunk_reduce_bytes(numel, x.element_size(), world))
                       for kind in ("attention", "mlp")]
            ys = [symm_buffers.data_view(buffers[k % 2], rank, x.dtype, at, numel)
                  .view(-1, hidden) for k in range(stages)]
            self.parts.append(Stages(model, x[mb:mb + 1], ys,
                                     [reduce_site(buffers[k % 2]) for k in range(stages)]))
            self.targets.append([[t.view(-1, hidden) for t in symm_buffers.peer_views(
                buffers[k % 2], x.dtype, at, numel)] for k in range(stages)])

    def __call__(self):
        for part in self.parts:
            part.first_norm()
        if self.name != "pipelined":  # the same order, nothing to wait for
            for step, mb, k in schedule(len(self.parts[0].ys), len(self.parts)):
                getattr(self.parts[mb], step)(k)
            return torch.cat([part.h[-1] for part in self.parts])
        caller = torch.cuda.current_stream()
        copied = {}
        for step, mb, k in schedule(len(self.parts[0].ys)):
            part = self.parts[mb]
            if step == "compute":
                part.compute(k)
                self.copy_stream.wait_stream(caller)  # after this stage's GEMM
                with torch.cuda.stream(self.copy_stream):
                    for target in self.targets[mb][k]:
                        target.copy_(part.ys[k])
                    copied[mb, k] = self.copy_stream.record_event()
            else:
                caller.wait_event(copied.pop((mb, k)))
                part.site(k)
        caller.wait_stream(self.copy_stream)
        return torch.cat([part.h[-1] for part in self.parts])


def reference(model, x, group):
    """The same layers with NCCL all_reduces and fp32 sums of the residual stream: the values
    every variant should come near."""
    h = rms_norm(x, model.layers[0].attn_norm, model.cfg.eps)
    residual = x
    rows = x.shape[0] * x.shape[1]
    for k, weight in enumerate(stage_norms(model)):
        y = torch.empty(rows, x.shape[2], dtype=x.dtype, device=x.device)
        compute_into(model, k, h, y)
        dist.all_reduce(y, group=group)
        residual = (y.view(x.shape).float() + residual.float()).to(x.dtype)
        h = rms_norm(residual, weight, model.cfg.eps)
    return h


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help="tokens a forward: two sequences of half of it")
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="interleaved rounds of the variants")
    parser.add_argument("--variants", type=variant_list, default=VARIANTS + ROW_SPLITS,
                        help="comma-separated; the floor is always timed")
    parser.add_argument("--trace", metavar="DIR",
                        help="also write a profiler trace of one forward of each variant, per "
                             "rank (Chrome trace JSON)")
    add_probe_arguments(parser, watchdog=300)
    args = parser.parse_args(argv)
    device, timer = start_probe(args)
    group, rank0 = dist.group.WORLD, dist.get_rank() == 0
    cfg = ModelConfig(args.layers, 4096, 14336, 32, 8, args.tokens // MICROBATCHES)
    dtype = torch.bfloat16
    model = Decoder(cfg, group, device, dtype)
    shared = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(MICROBATCHES, args.tokens // MICROBATCHES, cfg.hidden, generator=shared,
                    device=device).to(dtype)
    want = reference(model, x, group).float()
    variants = {name: Variant(name, model, x, group, device) if name in VARIANTS
                else RowSplit(name, model, x, stage_norms(model), group, device)
                for name in args.variants}
    checks = {}
    for name, run in variants.items():
        got = run().float().view(want.shape)
        torch.cuda.synchronize(device)
        error = float((got - want).norm() / want.norm())
        checks[name] = f"rel. L2 {error:.2e}, " + ("same bits" if bits_agree(got)[0]
                                                    else "RANKS DIFFER")
    if "pipelined" in variants:
        pipelined = variants["pipelined"]

        def barriers_alone():  # the pipelined sites' barrier kernels, in its order, nothing else
            for step, mb, k in schedule(len(pipelined.parts[0].ys)):
                if step == "site":
                    for kernel_launch in pipelined.parts[mb].launch_lists[k][::2]:
                        launch(kernel_launch)
        variants["pipelined's barriers alone"] = barriers_alone
        checks["pipelined's barriers alone"] = ""
    if args.trace:
        for name, run in variants.items():
            trace(timer, run, f"{args.trace}/{name.replace(' ', '_')}_rank{dist.get_rank()}.json")
    times = {name: [] for name in variants}
    for turn in range(args.rounds):
        for name in list(variants)[::-1 if turn % 2 else 1]:
            times[name].append(timer.graph(variants[name]) * 1e3)
    if rank0:
        print(f"{torch.cuda.get_device_name(device)} x {dist.get_world_size()}, "
              f"{args.tokens} tokens ({MICROBATCHES} x {args.tokens // MICROBATCHES}), "
              f"{args.layers} layers; ms per forward by round, max over ranks; every other "
              "round in reverse order")
        print("| variant | ms (rounds) | median | / floor (median of the rounds' ratios) | "
              "check |\n|---|---|---|---|---|")
        for name, samples in times.items():
            ratios = [t / f for t, f in zip(samples, times["floor"])]
            print(f"| {name} | {' / '.join(f'{t:.3f}' for t in samples)} | {median(samples):.3f} "
                  f"| {median(ratios):.3f} | {checks[name]} |", flush=True)
    dist.destroy_process_group()


def variant_list(text: str) -> tuple:
    names = tuple(dict.fromkeys(["floor"] + text.split(",")))
    unknown = [name for name in names if name not in VARIANTS + ROW_SPLITS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; known: "
                                         f"{', '.join(VARIANTS + ROW_SPLITS)}")
    return names


def median(values):
    return sorted(values)[len(values) // 2]


def trace(timer, run, path):
    """One forward, captured in a CUDA graph and replayed under the profiler, to `path`."""
    graph = timer.capture(run, 1)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        graph.replay()
        torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    profile.export_chrome_trace(path)
    dist.barrier()


if __name__ == "__main__":
    main()
