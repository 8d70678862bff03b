"""`matmul_chunks{C}_p{P}`: the matmul that feeds an all_reduce (config.matmul_prologue), computed
by torch (cuBLAS) in C chunks of rows; each chunk's all-reduce and epilogue
(`one_shot_lamport_streamed` on at most P programs) runs on a side stream as soon as the chunk's
rows exist, so the reduction of chunk c runs while the GEMM of chunk c + 1 does.

Unfused torch equivalent (w [N, K] with transpose_weight, else [K, N]):
    y = x @ w.T (+ bias);  y = prologue(y);  dist.all_reduce(y);  out = epilogue(y)
as run here, the rows of x in C chunks:
    for each chunk c:  y_c = x[c] @ w.T (+ bias)                  # the caller's stream
                       out[c] = streamed_all_reduce(y_c)          # the side stream, after y_c
    then the caller's stream waits for the side stream

Why not gemm_one_shot (kernels/gemm_all_reduce.py), which pushes tiles from inside a Triton GEMM:
that GEMM trails cuBLAS at prefill sizes, so on two H100s it hid nothing (docs/benchmarks.md,
"GEMM + all-reduce overlap"). Here the GEMM stays cuBLAS's, and what overlaps is whole chunks.
The reduction's programs leave the other SMs to the GEMM (P caps them); a Lamport program only
polls for its peers' rows, so it never waits on a GEMM of its own rank.

Each chunk's kernel sums the ranks in rank order, so every rank gets the same bits. The site
stays synchronous: the side stream is joined before it returns, so no other symmetric-memory
launch of the group can run beside its chunks, and every rank launches the same chunks in the
same order (the chunks depend on shapes only).

Not registered with the engine (scheduler/backends/cuda.py): interpreted on CPU ranks it gives
the reference's values and the same bits on every rank (tests/test_symm_matmul_chunks.py), but
on 2 H100s (session 19) a compile-time warm-up of a 4-chunk split trapped after the
symmetric-memory timeout: four launches on the warm-up's scratch, the third polling places the
first had emptied (`warm_up_split` now launches two; reproduced and tested interpreted). Until
the GPU check passes with that change, the engine does not offer it:
`torchrun --nproc-per-node=2 tests/gpu_gemm_worker.py --chunks` (docs/notes_symm.md, "Session
19").
"""

from __future__ import annotations

import math

import torch

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning
from infini_dist.scheduler.backends.symm import STREAMED_MAX_BUFFER_BYTES, TWO_SHOT_MAX_BYTES
from infini_dist.scheduler.backends.symm_gemm import GemmPlan, plan_gemm
from infini_dist.scheduler.backends.symm_launch import PreparedAtFirstCall, warm_up
from infini_dist.scheduler.choices import Algorithm

# Each chunk's all-reduce and epilogue (a module constant, not an attribute: the engine's
# SymmAllReduce algorithms are the ones with a `kernel` of their own for the whole span).
REDUCTION = lamport_one_shot_streamed_all_reduce

# Fewer rows a chunk and the chunks' launches cost more than their overlap saves: the split is
# for prefill, where one chunk's GEMM takes tens of µs.
MIN_CHUNK_ROWS = 128


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk, the first `rows % chunks` a row longer."""
    size, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + size + (c < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _per_row(shape, tail_shape) -> bool | None:
    """True for an operand laid out like the output (sliced with its rows), False for one the
    same for every row (a vector over the last dim, a scalar), None for anything else."""
    if tuple(shape) == tuple(tail_shape):
        return True
    return False if all(d == 1 for d in tuple(shape)[:-1]) else None


class MatmulChunks(Algorithm):
    def __init__(self, chunks: int, programs: int, min_chunk_rows: int = MIN_CHUNK_ROWS):
        self.chunks, self.programs, self.min_chunk_rows = chunks, programs, min_chunk_rows
        self.name = f"matmul_chunks{chunks}_p{programs}"
        self._side_streams = {}  # device -> the stream this algorithm's reductions run on

    def plan(self, span, meta, ctx) -> GemmPlan | None:
        plan = plan_gemm(span, meta, ctx)
        if plan is None:
            return None
        tail = plan.tail
        if math.prod(tail.shape[:-1]) < self.chunks * self.min_chunk_rows or any(
                _per_row(meta[n].shape, tail.shape) is None for n in tail.tensor_inputs[1:]):
            return None
        chunk = self._chunk_rows(plan) * tail.shape[-1]
        if chunk * tail.dtype.itemsize > TWO_SHOT_MAX_BYTES or self.data_bytes(
                plan, ctx.world_size) > STREAMED_MAX_BUFFER_BYTES:
            return None
        return plan

    def supports(self, span, meta, ctx) -> bool:
        return self.plan(span, meta, ctx) is not None

    def _chunk_rows(self, plan: GemmPlan) -> int:
        """The rows of the largest chunk (chunk_bounds)."""
        return -(-math.prod(plan.tail.shape[:-1]) // self.chunks)

    def data_bytes(self, plan: GemmPlan, world_size: int) -> int:
        """The streamed kernel's buffer for the largest chunk."""
        tail = plan.tail
        return REDUCTION.data_bytes(self._chunk_rows(plan) * tail.shape[-1], tail.dtype.itemsize,
                                    world_size, tail.row_len, tail.norm)

    def _side_stream(self, device) -> torch.cuda.Stream:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device)
        return stream

    def launch(self, plan: GemmPlan, env: dict, buffer, tuning: SymmTuning = DEFAULT_TUNING):
        tail = plan.tail
        x = env[plan.x].reshape(-1, plan.k)
        weight = env[plan.w].t() if plan.transpose_weight else env[plan.w]
        bias = env[plan.bias] if plan.bias else None
        operands = {n: env[n].contiguous() for n in tail.tensor_inputs[1:]}
        row_wise = {n for n, t in operands.items() if _per_row(t.shape, tail.shape)}
        written = tail.allocate(x.device)
        width = tail.shape[-1]
        side = self._side_stream(x.device) if x.is_cuda else None
        caller = torch.cuda.current_stream(x.device) if side is not None else None
        chunks = []  # alive until the join: the side stream reads them after the caller moves on
        for start, end in chunk_bounds(x.shape[0], self.chunks):
            rows = x[start:end]
            y = rows @ weight if bias is None else torch.addmm(bias, rows, weight)
            chunks.append(y)
            tensors = {n: t.view(-1, width)[start:end] if n in row_wise else t
                       for n, t in operands.items()}
            outputs = {k: t.view(-1, t.shape[-1])[start:end] for k, t in written.items()}
            if side is None:
                self._reduce(y, tail, tensors, outputs, buffer, tuning)
                continue
            side.wait_stream(caller)  # after this chunk's GEMM
            with torch.cuda.stream(side):
                self._reduce(y, tail, tensors, outputs, buffer, tuning)
        if side is not None:
            caller.wait_stream(side)
        return tail.results(written)

    def _reduce(self, y, tail, tensors, outputs, buffer, tuning):
        kernel, grid, args, kwargs = REDUCTION.launch(
            y, buffer, tuning=tuning, **tail.launch_options(tensors), **outputs)
        kernel[(min(grid[0], self.programs),)](*args, **kwargs)

    def warm_up_split(self) -> MatmulChunks:
        """The split the compile step's warm-up launches: at most two chunks. Its scratch
        (symm_buffers.local_scratch) has no peer to refill the places a poll empties, so a third
        launch on it would poll a half that the first emptied, and wait for ever."""
        return MatmulChunks(min(self.chunks, 2), self.programs, min_chunk_rows=0)

    def compile(self, span, meta, ctx):
        plan = self.plan(span, meta, ctx)
        _, tuning, _ = warm_up(self.warm_up_split(), plan, plan and plan.tensor_inputs, meta,
                               ctx)
        data_bytes = self.data_bytes(plan, ctx.world_size)

        def prepare(env):  # the first call, collective: the group's buffer
            buffer = symm_buffers.get_buffer(ctx.group, ctx.device, REDUCTION.kind, data_bytes,
                                             REDUCTION.lamport_width(plan.tail.dtype))
            return lambda call_env: self.launch(plan, call_env, buffer, tuning)
        return PreparedAtFirstCall(prepare)


def algorithms() -> list[MatmulChunks]:
    """The splits to offer: two or four chunks, the reduction on 32 programs (about 100 of an
    H100's 132 SMs left to the GEMM) or on up to 128. Not registered yet (the module's
    docstring)."""
    return [MatmulChunks(2, 32), MatmulChunks(4, 32), MatmulChunks(4, 128)]
