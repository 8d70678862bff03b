"""`matmul_ce_chunks{C}`: the matmul that feeds an all_reduce (config.matmul_prologue), computed
by torch (cuBLAS) in C chunks of rows, each chunk moved to the peers by a copy engine while the
next chunk's GEMM runs, then reduced with the epilogue (kernels/chunk_reduce.py).

Unfused torch equivalent (w [N, K] with transpose_weight, else [K, N]):
    y = x @ w.T (+ bias);  dist.all_reduce(y);  out = epilogue(y)
as run here, the rows of x in C chunks, into this rank's slot of a symmetric buffer:
    caller's stream:  GEMM 0, GEMM 1, reduce 0, GEMM 2, reduce 1, ..., reduce C-1
    side stream:      after GEMM c, copy chunk c into slot `rank` of every peer (copy engine)
    reduce c waits for copy c; the caller's stream waits for the last copy before it returns.

Why a copy engine (`launch/bench_overlap.py`, docs/notes_symm.md "Session 20"): beside a cuBLAS
GEMM a copy-engine push of 16 MiB was 84-98% hidden, while the streamed Lamport kernel on a side
stream made the pair slower than the two in sequence (its programs take SMs the GEMM's waves
need), which is why session 19's split, the streamed kernel per chunk, lost to the unsplit site
by 20-50%. This one came within 2-4% of the unsplit site at 2048 tokens (the numbers in
docs/notes_symm.md); the engine times it beside the others and commits it only where it wins.

Every rank sums the slots in rank order: the same bits everywhere. The site is synchronous, and
every rank launches the same chunks in the same order (they depend on shapes only).
"""

from __future__ import annotations

import math

import torch

from infini_dist.kernels import chunk_reduce as kernel_module
from infini_dist.kernels import symm_buffers
from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning
from infini_dist.scheduler.backends.symm_gemm import GemmPlan, plan_gemm
from infini_dist.scheduler.backends.symm_launch import SideStreams, compile_on_buffer
from infini_dist.scheduler.choices import Algorithm

# Fewer rows a chunk and the chunks' launches cost more than their overlap saves: the split is
# for prefill, where one chunk's GEMM takes tens of µs.
MIN_CHUNK_ROWS = 128
MAX_BYTES = 32 << 20  # the output; the buffer holds W of it (a 4096-token prefill at 4096 wide)


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk, the first `rows % chunks` a row longer."""
    size, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + size + (c < extra)
        bounds.append((start, end))
        start = end
    return bounds


class MatmulChunks(Algorithm):
    def __init__(self, chunks: int, min_chunk_rows: int = MIN_CHUNK_ROWS):
        self.chunks, self.min_chunk_rows = chunks, min_chunk_rows
        self.name = f"matmul_ce_chunks{chunks}"
        self._side_stream = SideStreams()  # where this algorithm's copies run

    def plan(self, span, meta, ctx) -> GemmPlan | None:
        plan = plan_gemm(span, meta, ctx)
        if plan is None:
            return None
        tail = plan.tail
        # the GEMM's rows go to the peers as they are: no op between the matmul and the sum
        if (tail.prologue or math.prod(tail.shape[:-1]) < self.chunks * self.min_chunk_rows
                or tail.numel * tail.dtype.itemsize > MAX_BYTES):
            return None
        return plan

    def supports(self, span, meta, ctx) -> bool:
        return self.plan(span, meta, ctx) is not None

    def data_bytes(self, plan: GemmPlan, world_size: int) -> int:
        return kernel_module.chunk_reduce_bytes(plan.tail.numel, plan.tail.dtype.itemsize,
                                                world_size)

    def launch(self, plan: GemmPlan, env: dict, buffer, tuning: SymmTuning = DEFAULT_TUNING):
        tail = plan.tail
        x = env[plan.x].reshape(-1, plan.k)
        weight = env[plan.w].t() if plan.transpose_weight else env[plan.w]
        bias = env[plan.bias] if plan.bias else None
        tensors = {n: env[n].contiguous() for n in tail.tensor_inputs[1:]}
        options = tail.launch_options(tensors)
        written = tail.allocate(x.device)
        width, stride, rank = tail.shape[-1], slot_elements(tail.numel), buffer.rank
        mine = symm_buffers.data_view(buffer, rank, tail.dtype, rank * stride, tail.numel)
        y = mine.view(-1, width)
        targets = [t.view(-1, width) for t in symm_buffers.peer_views(
            buffer, tail.dtype, rank * stride, tail.numel)]
        side = self._side_stream(x.device) if x.is_cuda else None
        caller = torch.cuda.current_stream(x.device) if side is not None else None
        bounds = chunk_bounds(x.shape[0], self.chunks)
        reductions = kernel_module.chunk_reduce_launches(
            mine.view(tail.shape), buffer,
            chunks=[(start * width, (end - start) * width) for start, end in bounds],
            tuning=tuning, **options, **written)
        copied = []

        def reduce(c):
            if side is not None:
                caller.wait_event(copied[c])
            for kernel, grid, args, kwargs in reductions[c]:
                kernel[grid](*args, **kwargs)

        for c, (start, end) in enumerate(bounds):
            rows = x[start:end]
            if bias is None:
                torch.mm(rows, weight, out=y[start:end])
            else:
                torch.addmm(bias, rows, weight, out=y[start:end])
            if side is not None:
                side.wait_stream(caller)  # after this chunk's GEMM
            with torch.cuda.stream(side):  # None (off the GPU): the copies in order, here
                for target in targets:
                    target[start:end].copy_(y[start:end])
                copied.append(side.record_event() if side is not None else None)
            if c > 0:  # the previous chunk's copy had this chunk's GEMM to hide under
                reduce(c - 1)
        reduce(self.chunks - 1)
        return tail.results(written)

    def compile(self, span, meta, ctx):
        plan = self.plan(span, meta, ctx)
        return compile_on_buffer(self, plan, meta, ctx, kernel_module.KIND,
                                 lambda buffer, env, tuning, fast: lambda call_env: self.launch(
                                     plan, call_env, buffer, tuning))


def algorithms() -> list[MatmulChunks]:
    """The splits to offer: two chunks. Four leave a quarter of the transfer after the last GEMM
    rather than half, but cost the GEMM more (2048 x 7168 -> 4096: +9%, two +1.6%) and add a
    chunk's launches and barrier twice; on 2 H100s they ran 20% over the unsplit site where two
    ran 2-4% over it (session 20)."""
    return [MatmulChunks(2)]
