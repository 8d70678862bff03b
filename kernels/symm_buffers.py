"""Symmetric buffers for our all-reduce kernels: allocated and rendezvoused once, then reused.

One buffer per (group, device, kind, size class). A kind (an algorithm: 'one_shot',
'two_shot_lamport', ...) has its own buffers because the kernels' reuse arguments hold only
between launches of the same protocol.
Each allocation is laid out as

    [ flags: MAX_PROGRAMS x world_size int32 | call counters: MAX_PROGRAMS int32 | pad | data ]

The flags and counters are zeroed before the rendezvous, which is collective: once it returns on
any rank, every rank has zeroed its own. Buffers of the Lamport kinds (`lamport_width` = 16 or
32) also get every data element set to the empty pattern (-0.0 of that width) before it.

Allocation is collective and blocks the host, so it must happen on every rank in the same order
and never inside a CUDA-graph capture (allocating during capture silently corrupts memory). The
algorithms call `get_buffer` lazily from their first run, which the engine makes in lockstep on
all ranks and eagerly; a capture that would need a new buffer raises instead.

Launches on one buffer must be ordered on one stream: the kernels' reuse arguments rely on a
launch starting only after the previous one on that buffer has finished.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from infini_dist.kernels.symm_chain import MAX_PROGRAMS

MIN_CLASS_BYTES = 1 << 20
_DATA_ALIGN = 256


@dataclass
class SymmBuffer:
    storage: torch.Tensor       # this rank's allocation (uint8), header included
    data_table: torch.Tensor    # int64 [world_size] on the device: each rank's data address
    signal_table: torch.Tensor  # int64 [world_size]: each rank's flag address
    epoch: torch.Tensor         # int32 [MAX_PROGRAMS]: this rank's call counters
    rank: int
    world_size: int
    data_bytes: int
    handle: object = None       # the torch symmetric-memory handle (keeps the mapping alive)
    storages: tuple = ()        # every rank's allocation (uint8) as a tensor of this process


def flags_bytes(world_size: int) -> int:
    return MAX_PROGRAMS * world_size * 4


def header_bytes(world_size: int) -> int:
    used = flags_bytes(world_size) + MAX_PROGRAMS * 4  # flags, then the call counters
    return -(-used // _DATA_ALIGN) * _DATA_ALIGN


def slot_elements(numel: int) -> int:
    """`numel` rounded up to 64 elements: keeps every slot 128-byte aligned."""
    return -(-numel // 64) * 64


def part_elements(buffer, element_size: int, parts: int) -> int:
    """Elements in 1/`parts` of the buffer's data, rounded down to 64: where fixed regions
    start, the same for every shape. (Regions sized by the shape would overlap across a shape
    change: a peer one call ahead, writing the other half of a bigger call, would land in the
    half this call is reading.)"""
    return buffer.data_bytes // element_size // parts // 64 * 64


def upper_half_elements(buffer, element_size: int) -> int:
    """Where the upper half of the buffer's data starts, in elements: the same byte offset
    (256-byte aligned) for every element size, so a region placed there by a call of one dtype
    is never reached by the lower region of a call of another."""
    return buffer.data_bytes // 2 // 256 * 256 // element_size


def data_view(buffer: SymmBuffer, rank: int, dtype: torch.dtype, offset: int,
              numel: int) -> torch.Tensor:
    """Elements [offset, offset + numel) of `rank`'s data, as `dtype`: a tensor of this process,
    so that a copy into a peer's is made by a copy engine and takes no SM."""
    start = header_bytes(buffer.world_size) + offset * dtype.itemsize
    return buffer.storages[rank][start:start + numel * dtype.itemsize].view(dtype)


def peer_views(buffer: SymmBuffer, dtype: torch.dtype, offset: int, numel: int) -> list:
    """`data_view` of every other rank at the same place: where this rank's values go by copy.
    A scratch's "peers" are this rank's own memory: none."""
    mine = data_view(buffer, buffer.rank, dtype, offset, numel).data_ptr()
    views = (data_view(buffer, peer, dtype, offset, numel) for peer in range(buffer.world_size))
    return list({t.data_ptr(): t for t in views if t.data_ptr() != mine}.values())


def _from_addresses(storage, bases, rank, world_size, data_bytes, handle=None,
                    storages=()) -> SymmBuffer:
    header = header_bytes(world_size)
    device = storage.device
    signals = torch.tensor(bases, dtype=torch.int64, device=device)
    data = torch.tensor([b + header for b in bases], dtype=torch.int64, device=device)
    flags_end = flags_bytes(world_size)
    epoch = storage[flags_end:flags_end + MAX_PROGRAMS * 4].view(torch.int32)
    return SymmBuffer(storage, data, signals, epoch, rank, world_size, data_bytes, handle,
                      tuple(storages))


def from_peer_tensors(storages: list, rank: int) -> SymmBuffer:
    """A buffer over tensors all mapped in this process (tests: shared CPU memory standing in
    for symmetric memory). Each tensor is uint8 with a zeroed header."""
    world_size = len(storages)
    nbytes = min(s.numel() for s in storages)
    return _from_addresses(storages[rank], [s.data_ptr() for s in storages], rank, world_size,
                           nbytes - header_bytes(world_size), storages=storages)


def _group_name(group) -> str:
    return (group or dist.group.WORLD).group_name


EMPTY_PATTERN = {16: (torch.int16, -(1 << 15)), 32: (torch.int32, -(1 << 31))}


def fill_empty(storage: torch.Tensor, world_size: int, lamport_width: int) -> None:
    """Set every data element of `storage` (a whole buffer, header first) to the Lamport empty
    pattern of `lamport_width` bits."""
    dtype, bits = EMPTY_PATTERN[lamport_width]
    storage[header_bytes(world_size):].view(dtype).fill_(bits)


def allocate(group, device: torch.device, data_bytes: int, lamport_width: int = 0) -> SymmBuffer:
    """Collective over `group`: allocate and rendezvous one buffer with `data_bytes` of data."""
    import torch.distributed._symmetric_memory as symm_mem

    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("infini_dist: a symmetric buffer must be allocated before CUDA-graph "
                           "capture; run the op once eagerly (on every rank) before capturing")
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    header = header_bytes(world_size)
    with torch.cuda.device(device):
        storage = symm_mem.empty(header + data_bytes, dtype=torch.uint8, device=device)
        storage[:header].zero_()
        if lamport_width:
            fill_empty(storage, world_size, lamport_width)
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(storage, _group_name(group))
        if handle.rank != rank or handle.world_size != world_size:
            raise RuntimeError(f"infini_dist: symmetric-memory handle is rank {handle.rank} of "
                               f"{handle.world_size}, the group says {rank} of {world_size}")
        offset = storage.data_ptr() - handle.buffer_ptrs[rank]
        offsets = [None] * world_size
        dist.all_gather_object(offsets, offset, group=group)
    if len(set(offsets)) != 1 or offset < 0 or offset + header + data_bytes > handle.buffer_size:
        raise RuntimeError(f"infini_dist: symmetric tensors sit at different offsets on the "
                           f"ranks ({offsets}); cannot address peers")
    bases = [base + offset for base in handle.buffer_ptrs]
    storages = [storage if peer == rank else handle.get_buffer(
        peer, (header + data_bytes,), torch.uint8, storage_offset=offset)
        for peer in range(world_size)]
    return _from_addresses(storage, bases, rank, world_size, data_bytes, handle, storages)


_BUFFERS: dict[tuple, list[SymmBuffer]] = {}
_LOCK = threading.Lock()


def size_class(data_bytes: int) -> int:
    return max(MIN_CLASS_BYTES, 1 << (max(1, data_bytes) - 1).bit_length())


def get_buffer(group, device: torch.device, kind: str, data_bytes: int,
               lamport_width: int = 0) -> SymmBuffer:
    """The smallest cached buffer of this (group, device, kind) that holds `data_bytes`, else a
    new one of the next size class. Every rank holds the same buffers after the same calls, so
    every rank picks the same one. Lamport buffers of different widths never mix (the empty
    pattern differs), so the width is part of the key."""
    key = (_group_name(group), torch.device(device), kind, lamport_width)
    with _LOCK:
        for buffer in _BUFFERS.get(key, ()):
            if buffer.data_bytes >= data_bytes:
                return buffer
        buffer = allocate(group, torch.device(device), size_class(data_bytes), lamport_width)
        _BUFFERS.setdefault(key, []).append(buffer)
        _BUFFERS[key].sort(key=lambda b: b.data_bytes)
        return buffer


def cached_buffers() -> dict:
    """(group name, device, kind, lamport width) -> data sizes in bytes; for tests and reports."""
    with _LOCK:
        return {key: [b.data_bytes for b in buffers] for key, buffers in _BUFFERS.items()}


def local_scratch(world_size: int, rank: int, data_bytes: int, device) -> SymmBuffer:
    """A buffer whose every 'peer' is this rank's own scratch memory, with flags pre-raised so
    that no barrier waits, and zeroed data so that no Lamport poll waits: one launch on it
    compiles and runs a kernel with no cross-rank traffic (the compile step's warm-up). Its data
    come out meaningless."""
    header = header_bytes(world_size)
    storage = torch.zeros(header + data_bytes, dtype=torch.uint8, device=device)
    storage[:flags_bytes(world_size)].view(torch.int32).fill_(1 << 30)  # any barrier count
    bases = [storage.data_ptr()] * world_size
    return _from_addresses(storage, bases, rank, world_size, data_bytes,
                           storages=[storage] * world_size)
