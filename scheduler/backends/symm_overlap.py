"""`ce_overlap`: an all_reduce whose transfer a copy engine makes while the site's beside work
(the weight-gradient GEMMs of a backward graph, fusion type "overlap") runs on the SMs, then the
reduction with the epilogue (kernels/chunk_reduce.py, the whole tensor as one chunk).

Unfused torch equivalent (a column-parallel linear's backward):
    dw = dy.T @ x                        # beside: independent of the all_reduce
    dist.all_reduce(p);  out = epilogue(p)
as run here:
    side stream:      once p is ready, copy it into slot `rank` of every peer's buffer
    caller's stream:  the beside GEMMs (cuBLAS), then, after the copies: a barrier, this rank's
                      p and the peers' slots summed in rank order with the epilogue, a barrier
                      (`ce_overlap_aside`: those three on the side stream after the copies,
                      beside the GEMMs too)

Why a copy engine: beside a cuBLAS GEMM a copy-engine push was 84-98% hidden on 2 H100s, where
our Lamport kernel on a side stream made the pair slower than the two in sequence (its programs
hold SMs the GEMM's waves need) and NCCL hid 23-70% (launch/bench_overlap.py, docs/notes_symm.md
"Session 20"). The engine times the site whole, GEMMs included, so this choice is committed only
where the overlap beats every synchronous choice plus its GEMMs. On 2 H100s, in CUDA-graph
replay, it did by 3-14% beside gate_up's weight gradient and 21-23% beside qkv's at 2048
tokens; but an eager training step with it was slower (docs/notes_symm.md, "Session 21"),
also once a call's host time was cut from 215-437 µs to 108-188 (the fork, copies and join
as driver calls, session 22): the fusion type that offers it is off by default.

Every rank sums the slots in rank order: the same bits everywhere. The site stays synchronous:
the caller's stream waits for the copies before the reduction, so no input is read after the
site returns (no record_stream), and every rank launches the same work in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infini_dist.kernels import chunk_reduce as kernel_module
from infini_dist.kernels import cuda_driver
from infini_dist.kernels import symm_buffers
from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.nt_runtime import FastLaunch
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning
from infini_dist.scheduler.backends.symm import SpanPlan, plan_span
from infini_dist.scheduler.backends.symm_gemm import layout_of
from infini_dist.scheduler.backends.symm_launch import SideStreams, compile_on_buffer
from infini_dist.scheduler.choices import Algorithm, FusedSpan, run_nodes

# Below this the copy's launch and the two barriers cost more than the transfer they hide (a
# backward's input gradient at 128 tokens of 4096 bf16 is 1 MiB).
MIN_BYTES = 1 << 20
MAX_BYTES = 64 << 20  # the tensor; the buffer holds W of it (8192 tokens of 4096 bf16)


@dataclass(frozen=True)
class OverlapPlan:
    tail: SpanPlan          # all_reduce and epilogue; source: the all_reduce's input
    graph: object           # the site's SubGraph
    beside: tuple           # node indices of the work run while the copies fly
    beside_inputs: tuple    # the values that work reads
    ctx: object             # the RunContext that work runs under (natively)

    @property
    def tensor_inputs(self) -> tuple:
        return tuple(dict.fromkeys(self.tail.tensor_inputs + self.beside_inputs))


def algorithms() -> list:
    """The reduction after the GEMMs on the caller's stream, or beside them on the side
    stream after the copies: the engine times both with the GEMMs."""
    return [CopyEngineOverlap(), CopyEngineOverlap(reduce_aside=True)]


class CopyEngineOverlap(Algorithm):
    runs_beside = True

    def __init__(self, reduce_aside: bool = False):
        # reduce_aside: the barriers and the reduction follow the copies on the side stream,
        # beside the GEMMs too, where a long GEMM leaves room for them (gate_up's weight
        # gradient: 316 µs at 2048 tokens against about 30 for the reduction)
        self.reduce_aside = reduce_aside
        self.name = "ce_overlap_aside" if reduce_aside else "ce_overlap"
        self._side_stream = SideStreams()  # where this algorithm's copies run

    def plan(self, span, meta, ctx) -> OverlapPlan | None:
        if not span.beside or span.prologue:
            return None
        tail = plan_span(FusedSpan(span.graph, (), span.anchors, span.epilogue), meta, ctx)
        if tail is None:
            return None
        size = tail.numel * tail.dtype.itemsize
        if not MIN_BYTES <= size <= MAX_BYTES:
            return None
        reads = tuple(dict.fromkeys(name for i in span.beside
                                    for name in span.graph.nodes[i].inputs))
        if any(meta.get(name) is None or meta[name].device.type != "cuda" for name in reads):
            return None
        return OverlapPlan(tail, span.graph, span.beside, reads, ctx)

    def supports(self, span, meta, ctx) -> bool:
        return self.plan(span, meta, ctx) is not None

    def data_bytes(self, plan: OverlapPlan, world_size: int) -> int:
        return kernel_module.chunk_reduce_bytes(plan.tail.numel, plan.tail.dtype.itemsize,
                                                world_size)

    def peer_slots(self, plan: OverlapPlan, buffer) -> list:
        """Slot `rank` of every peer's buffer: where this rank's values go. The reduction reads
        this rank's share from the source itself: with a copy into its own slot as well (a copy
        within one GPU) the choice lost to the synchronous ones by 2-12% on 2 H100s, and won by
        3-23% without it (session 21)."""
        tail = plan.tail
        return symm_buffers.peer_views(buffer, tail.dtype, buffer.rank * slot_elements(tail.numel),
                                       tail.numel)

    def reduction(self, plan: OverlapPlan, source, tensors: dict, written: dict, buffer,
                  tuning: SymmTuning = DEFAULT_TUNING) -> list:
        """The barrier, the reduction with the epilogue and the barrier: [(kernel, grid, args,
        kwargs)]; `source` in the plan's shape, the object the launches read."""
        tail = plan.tail
        (launches,) = kernel_module.chunk_reduce_launches(
            source, buffer, chunks=[(0, tail.numel)], tuning=tuning,
            **tail.launch_options(tensors), **written)
        return launches

    def run(self, plan: OverlapPlan, env: dict, source, targets: list, reduce) -> dict:
        """The copies of `source` into `targets` on the side stream, the beside work, and
        `reduce()` (the reduction's launches) on the stream this choice puts it on."""
        side = self._side_stream(source.device) if source.is_cuda else None
        caller = torch.cuda.current_stream(source.device) if side is not None else None
        if side is not None:
            side.wait_stream(caller)  # after p is made
        with torch.cuda.stream(side):  # None (off the GPU): the copies here, in order
            for target in targets:
                target.copy_(source.view(-1))
            if self.reduce_aside:
                reduce()
            done = side.record_event() if side is not None else None
        made = self.beside_work(plan, env)
        if side is not None:
            caller.wait_event(done)
        if not self.reduce_aside:
            reduce()
        return made

    @staticmethod
    def beside_work(plan: OverlapPlan, env: dict) -> dict:
        """The beside work, natively, on the current stream: its outputs."""
        graph = plan.graph
        beside = {n: env[n] for n in plan.beside_inputs}
        run_nodes(graph, plan.beside, beside, plan.ctx, native=True)
        return {name: beside[name] for i in plan.beside for name in graph.nodes[i].outputs}

    def launch(self, plan: OverlapPlan, env: dict, buffer,
               tuning: SymmTuning = DEFAULT_TUNING) -> dict:
        """One call through Triton's normal launch path; inputs of any layout."""
        tail = plan.tail
        source = env[tail.source].contiguous()
        tensors = {n: env[n].contiguous() for n in tail.tensor_inputs[1:]}
        written = tail.allocate(source.device)
        launches = self.reduction(plan, source.view(tail.shape), tensors, written, buffer,
                                  tuning)

        def reduce():
            for kernel, grid, args, kwargs in launches:
                kernel[grid](*args, **kwargs)
        made = self.run(plan, env, source, self.peer_slots(plan, buffer), reduce)
        return {**made, **tail.results(written)}

    def compile(self, span, meta, ctx):
        plan = self.plan(span, meta, ctx)

        return compile_on_buffer(self, plan, meta, ctx, kernel_module.KIND,
                                 lambda buffer, env, tuning, fast: PreparedOverlap(
                                     self, plan, buffer, env, tuning, fast))


@dataclass(frozen=True)
class DirectCalls:
    """What a call on the GPU hands the driver (kernels/cuda_driver.py): the raw handles of
    the side stream and of two events made once, the peers' slots' addresses; `keep` holds the
    torch objects those handles belong to."""
    driver: object
    device: int
    side: int
    fork: int
    done: int
    targets: tuple
    nbytes: int
    keep: tuple


def direct_calls(algorithm: CopyEngineOverlap, source: torch.Tensor, targets: list,
                 nbytes: int) -> DirectCalls | None:
    driver = cuda_driver.driver() if source.is_cuda else None
    if driver is None:
        return None
    side = algorithm._side_stream(source.device)
    (fork, fork_handle), (done, done_handle) = (cuda_driver.event_handle(source.device)
                                                for _ in range(2))
    return DirectCalls(driver, source.get_device(), side.cuda_stream, fork_handle, done_handle,
                       tuple(t.data_ptr() for t in targets), nbytes, (side, fork, done))


class PreparedOverlap:
    """The reduction's launches bound once (nt_runtime.FastLaunch, as symm_gemm.PreparedGemm
    binds its own), the peers' slots found once, and on the GPU the fork, copies and join made
    as driver calls on raw handles (DirectCalls): a training step runs these sites eagerly,
    where Triton's normal launch of three kernels, torch's stream switches and the argument
    packing cost more host time than the GPU spends on the site's transfer. A call whose
    inputs are laid out unlike the first call's takes `algorithm.launch`."""

    def __init__(self, algorithm: CopyEngineOverlap, plan: OverlapPlan, buffer, env: dict,
                 tuning: SymmTuning, fast: bool):
        self.algorithm, self.plan, self.buffer, self.tuning = algorithm, plan, buffer, tuning
        tail = plan.tail
        self.names = tail.tensor_inputs  # the source first
        self.layouts = tuple(layout_of(env[n]) for n in self.names)
        self.targets = algorithm.peer_slots(plan, buffer)
        self.enabled = fast and all(env[n].is_contiguous() for n in self.names)
        self.launches, self.direct = [], None
        if not self.enabled:
            return
        # Stand-ins, each its own object, so FastLaunch can tell the per-call tensors apart.
        inputs = {n: env[n].view(env[n].shape) for n in self.names}
        source = inputs[tail.source].view(tail.shape)
        written = {key: object() for key in tail.writes}
        per_call = [source] + [inputs[n] for n in self.names[1:]] + list(written.values())
        self.launches = [FastLaunch(kernel, grid, args, kwargs, per_call)
                         for kernel, grid, args, kwargs in algorithm.reduction(
                             plan, source, inputs, written, buffer, tuning)]
        self.direct = direct_calls(algorithm, source, self.targets,
                                   tail.numel * tail.dtype.itemsize)

    def __call__(self, env: dict) -> dict:
        tensors = [env[n] for n in self.names]
        if not self.enabled or any(layout_of(t) != layout or not t.is_contiguous()
                                   for t, layout in zip(tensors, self.layouts)):
            return self.algorithm.launch(self.plan, env, self.buffer, self.tuning)
        tail = self.plan.tail
        source = tensors[0]
        written = tail.allocate(source.device, source)
        per_call = [source.view(tail.shape)] + tensors[1:] + list(written.values())

        if self.direct is not None:
            return {**self._direct(env, source, per_call), **tail.results(written)}

        def reduce():
            for launch in self.launches:
                launch(*per_call)
        made = self.algorithm.run(self.plan, env, source, self.targets, reduce)
        return {**made, **tail.results(written)}

    def _direct(self, env: dict, source: torch.Tensor, per_call: list) -> dict:
        """`CopyEngineOverlap.run`'s order, the fork, copies and join as driver calls."""
        d, aside = self.direct, self.algorithm.reduce_aside
        driver, caller = d.driver, cuda_driver.raw_stream(d.device)
        driver.record(d.fork, caller)  # the copies read p, made on the caller's stream
        driver.wait(d.side, d.fork)
        address = source.data_ptr()
        for target in d.targets:
            driver.copy(target, address, d.nbytes, d.side)
        if aside:
            for launch in self.launches:
                launch(*per_call, stream=d.side)
        driver.record(d.done, d.side)
        made = self.algorithm.beside_work(self.plan, env)
        driver.wait(caller, d.done)
        if not aside:
            for launch in self.launches:  # on the current stream: the caller's
                launch(*per_call)
        return made
