"""The reduction of one row chunk of an all-reduce whose data a copy engine delivered: the second
half of `matmul_ce_chunks` (scheduler/backends/symm_chunked.py), which keeps the GEMM on cuBLAS
and moves its rows to the peers by copy engine, chunk by chunk, under the next chunk's GEMM.

Unfused torch equivalent, for the chunk's elements [first, first + count) of y:
    dist.all_reduce(y);  out = epilogue(y)      # every op rounds to y.dtype

Before the launch, every rank r has put its y's chunk into slot r of every rank's buffer (its
own slot by the GEMM's output, the peers' by copies on a copy engine) and only then launched
the reduction (its stream waits for the copies). So a barrier before it proves that every
peer's chunk has landed here. Then the W slots are summed in rank order 0..W-1 in fp32 and
rounded once, the same numbers in the same order on every rank: bitwise identical results. The
chunk's epilogue outputs are stored at their global offsets (the whole tensors are passed).

Reuse: the slots have one region, no halves, because a copy's destination is fixed when a CUDA
graph is captured (a device-side call counter cannot steer it). The last chunk of a call ends
with a second barrier: once it returns on a rank, every peer has read its slots, so that rank's
next call may overwrite them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import slot_elements
from infini_dist.kernels.symm_chain import fused_arguments, round_to
from infini_dist.kernels.symm_device import DEFAULT_TUNING, finish, item_range
from infini_dist.kernels.symm_signal import (block_barrier, peer_pointer, spin_until_set,
                                             world_size_pow2)

# Its own buffers (matmul_ce_chunks and ce_overlap share them and this protocol): no other
# protocol's launches touch its slots.
KIND = "chunk_reduce"
MAX_GRID = 1 << 16  # programs of a reduction; each takes items pid, pid + grid, ...


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def chunk_barrier_kernel(signal_table, rank, timeout_ns, WORLD_SIZE: tl.constexpr,
                         WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    """One program: every rank's arrival here (its own, then a kernel boundary, orders what
    comes after it on this rank's stream)."""
    block_barrier(signal_table, rank, 0, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def flag_wait_kernel(flags, rank, timeout_ns, WORLD_SIZE: tl.constexpr, WS_P2: tl.constexpr,
                     ON_GPU: tl.constexpr):
    """One program: wait until every peer's flag here (flags[source], set to 1 by the source's
    stream after its copies) is set, then clear them, acquiring what the copies wrote. Half a
    barrier: the setting side is a stream memory operation, not a kernel (launch/row_split.py's
    `rs_ag_spin`)."""
    sources = tl.arange(0, WS_P2)
    waited = (sources < WORLD_SIZE) & (sources != rank)
    spin_until_set(flags + sources, waited, timeout_ns, rank, ON_GPU)
    tl.debug_barrier()
    tl.atomic_xchg(flags + sources, 0, mask=waited, sem="acquire", scope="sys")


@triton.jit(do_not_specialize=["rank"])  # one compiled kernel for every rank
def chunk_reduce_kernel(x_ptr, epilogue, data_table, first, count, slot_stride, rank,
                        EPILOGUE: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr,
                        WORLD_SIZE: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    local = peer_pointer(data_table, rank, dtype) + first
    for item in range(tl.program_id(0).to(tl.int64), tl.cdiv(count, ITEM), tl.num_programs(0)):
        offset, mask = item_range(item, column, count, ITEM)  # int64 offsets
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            values = local + source * slot_stride
            if source == rank:  # this rank's own values are read where they are
                values = x_ptr + first
            total += tl.load(values + offset, mask=mask, other=0.0).to(tl.float32)
        finish(round_to(total, dtype), first + offset, column, mask, epilogue, EPILOGUE, ITEM)


def chunk_reduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Data bytes a call of `numel` elements needs: one slot per rank."""
    return world_size * slot_elements(numel) * element_size


def barrier_launch(buffer, on_gpu: bool, tuning=DEFAULT_TUNING) -> tuple:
    """(kernel, grid, args, kwargs): one barrier of every rank on `buffer`'s signals."""
    return (chunk_barrier_kernel, (1,), (buffer.signal_table, buffer.rank, tuning.timeout_ns),
            dict(WORLD_SIZE=buffer.world_size, WS_P2=world_size_pow2(buffer.world_size),
                 ON_GPU=on_gpu, num_warps=1))


def flag_wait_launch(flags, rank: int, world_size: int, tuning=DEFAULT_TUNING) -> tuple:
    """(kernel, grid, args, kwargs): wait for, and clear, the int32 flags[source] of every
    source rank but `rank`."""
    return (flag_wait_kernel, (1,), (flags, rank, tuning.timeout_ns),
            dict(WORLD_SIZE=world_size, WS_P2=world_size_pow2(world_size), ON_GPU=flags.is_cuda,
                 num_warps=1))


def chunk_reduce_launches(y, buffer, out, chunks: list[tuple[int, int]], *,
                          tuning=DEFAULT_TUNING, **options) -> list[list[tuple]]:
    """For each chunk (first, count) of y's elements (a whole number of rows where a norm
    follows), its [(kernel, grid, args, kwargs)]: the barrier, the reduction, and after the last
    chunk the barrier again. y: this rank's values, contiguous (its own slot, or the tensor the
    peers' slots were copied from: the reduction reads this rank's share from y and every
    peer's from its slot); its dtype and size set the layout. `out` and the options as in
    symm_chain.fused_arguments, packed once for every chunk.

    The barriers are kernels of one program, not the reduction's own first and last steps: a
    barrier per program would cap the reduction's grid at the signal slots (MAX_PROGRAMS), and
    128 programs left it at half the memory's speed (2 H100s, session 20: 22-27 µs for 1024
    rows x 4096 bf16)."""
    if options.get("prologue"):
        raise ValueError("chunk_reduce: the slots hold the values to sum; no prologue")
    layout, head, kwargs = fused_arguments(y, buffer, out, fold_row_max=tuning.fold_row_max,
                                           **options)
    del kwargs["PROLOGUE"], kwargs["WS_P2"], kwargs["ON_GPU"]
    barrier = barrier_launch(buffer, y.is_cuda, tuning)
    stride = slot_elements(y.numel())
    launches = []
    for first, count in chunks:
        grid = max(1, min(triton.cdiv(count, layout.item), MAX_GRID))
        launches.append([barrier, (chunk_reduce_kernel, (grid,), (
            head[0], head[2], buffer.data_table, first, count, stride, buffer.rank), kwargs)])
    launches[-1].append(barrier)
    return launches
