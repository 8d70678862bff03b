"""Sequence parallelism's span in one launch: reduce-scatter by rows, the epilogue on the rank's
own rows, all-gather of the result, through symmetric memory.

Unfused torch equivalent (x: [W * n, ...], every rank's partial sums; the residual, sides and
outputs of the epilogue are shards [n, ...]):
    shard = torch.empty(n, ...); dist.reduce_scatter_tensor(shard, x)     # rank r: rows r*n..
    out, h = epilogue(shard)                        # e.g. h = shard + residual; out = rms_norm(h)
    gathered = torch.empty(W * n, ...); dist.all_gather_into_tensor(gathered, out)

Rows are the last dim's rows; rank q owns shard rows [q*R, (q+1)*R) of the flattened tensor,
which is dim 0's chunk q. Phase 1: each rank pushes its rows of chunk q into staging slot
`rank` of owner q. Barrier. Phase 2: each owner sums its slots in rank order 0..W-1 in fp32 (the
same order everywhere, hence the same bits as one reduction), rounds to the dtype like the
reduce_scatter output, and runs the epilogue on whole rows (symm_chain.finish_item, with
shard-local offsets): its side outputs (the new residual, the rsqrt) go to this rank's tensors,
`out` to this rank's gathered region. Barrier. Phase 3 (GATHER): each rank copies every owner's
gathered region into its place in the gathered output. Program p handles shard rows p, p + grid,
... in every phase, so its barrier orders exactly the rows it moves.

Staging fills the lower half of the buffer and the gathered region starts at its upper half, at
offsets that do not depend on the shape: a rank that has left this launch writes peers' staging
in its next one before any barrier, while a peer may still copy gathered regions here. A
rank writes its own gathered region only after the next launch's first barrier, which every
peer reaches only once its previous launch, phase 3 included, is over (one stream).
"""

from __future__ import annotations

import triton
import triton.language as tl

from infini_dist.kernels.symm_buffers import slot_elements, upper_half_elements
from infini_dist.kernels.symm_device import apply_prologue, finish
from infini_dist.kernels.symm_signal import block_barrier, peer_pointer


@triton.jit(do_not_specialize=["rank", "timeout_ns"])
def reduce_scatter_all_gather_kernel(
        x_ptr, prologue, epilogue, gathered_ptr, data_table, signal_table, rows, gather_offset,
        rank, timeout_ns, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ROW: tl.constexpr,
        BLOCK: tl.constexpr, GATHER: tl.constexpr, WORLD_SIZE: tl.constexpr,
        WS_P2: tl.constexpr, ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    column = tl.arange(0, BLOCK)
    in_row = column < ROW
    shard = rows.to(tl.int64) * ROW
    first = pid.to(tl.int64)

    for row in range(first, rows, programs):  # phase 1: chunk q's rows to owner q
        for step in tl.static_range(WORLD_SIZE):
            owner = (rank + step) % WORLD_SIZE  # staggered, so owners are not all hit at once
            index = (owner * rows + row) * ROW + column
            x = tl.load(x_ptr + index, mask=in_row, other=0.0).to(tl.float32)
            x = apply_prologue(x, index, in_row, prologue, PROLOGUE, dtype)
            staging = peer_pointer(data_table, owner, dtype) + rank * shard
            tl.store(staging + row * ROW + column, x.to(dtype), mask=in_row)
    block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)

    local = peer_pointer(data_table, rank, dtype)
    for row in range(first, rows, programs):  # phase 2: own rows summed, epilogue
        index = row * ROW + column
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for source in tl.static_range(WORLD_SIZE):
            total += tl.load(local + source * shard + index, mask=in_row, other=0.0).to(
                tl.float32)
        finish(total.to(dtype).to(tl.float32), index, column, in_row, epilogue, EPILOGUE, ROW)

    if GATHER:  # phase 3: every owner's rows into the gathered output
        block_barrier(signal_table, rank, pid, timeout_ns, WORLD_SIZE, WS_P2, ON_GPU)
        out_dtype = gathered_ptr.dtype.element_ty
        for row in range(first, rows, programs):
            for step in tl.static_range(WORLD_SIZE):
                owner = (rank + step) % WORLD_SIZE
                region = peer_pointer(data_table, owner, out_dtype) + gather_offset
                value = tl.load(region + row * ROW + column, mask=in_row, other=0.0)
                tl.store(gathered_ptr + (owner * rows + row) * ROW + column, value, mask=in_row)


MAX_PROGRAMS = 128  # at most one per SM, so that program b of every rank is resident


def data_bytes(shard_numel: int, element_size: int, world_size: int) -> int:
    """Buffer bytes one call needs: two halves, the lower holding W staging slots of a shard."""
    return 2 * slot_elements(world_size * shard_numel) * element_size + 512


def layout(rows: int, row_len: int) -> tuple[int, int, int]:
    """(BLOCK, grid, num_warps) for shards of `rows` rows: from shapes alone, so every rank
    launches the same grid."""
    block = triton.next_power_of_2(row_len)
    return block, max(1, min(rows, MAX_PROGRAMS)), 4 if block <= 2048 else 8 if block <= 8192 \
        else 16


def local_region(buffer, dtype, numel: int):
    """This rank's gathered region as a tensor of `dtype`: where phase 2 writes `out`."""
    from infini_dist.kernels.symm_buffers import header_bytes
    start = header_bytes(buffer.world_size) + upper_half_elements(buffer, 1)
    return buffer.storage[start:start + numel * dtype.itemsize].view(dtype)
