"""The CUDA driver calls a copy-engine site makes on every call (an event recorded, a stream
made to wait for it, a device-to-device copy), through ctypes on libcuda, with raw handles.

Why not torch's: on 2 H100s a `ce_overlap` call's fork and join through torch
(`wait_stream`, `torch.cuda.stream(side)`, `record_event`, `wait_event`) cost 54-56 µs of host
time and its copy 13-14 µs, where the whole call's GPU time is about 100 µs (session 22,
`tests/gpu_overlap_worker.py`'s breakdown). Each of these is one driver call; made directly,
with the events made once, it is a ctypes call. Streams are the raw handles torch hands out
(`torch.cuda.Stream.cuda_stream`, `torch._C._cuda_getCurrentRawStream`), so the calls are
ordered with torch's own work on them, and a stream under CUDA-graph capture records them
as graph nodes (the fork and join of a captured side stream, a memcpy node), as torch's
calls would.

`Driver` is built once per process (`driver()`); `None` where there is no libcuda.

`write_value` (cuStreamWriteValue32, a stream memory operation) lets a stream itself set a
32-bit flag, a peer's included, once its earlier work is done; under capture it is a memop
node. launch/row_split.py's `rs_ag_spin` signals with it after its copies, in place of a
barrier kernel on the copy stream (session 31).
"""

from __future__ import annotations

import ctypes
import functools

import torch

SUCCESS = 0


class DriverError(RuntimeError):
    pass


class Driver:
    """cuEventRecord, cuStreamWaitEvent and cuMemcpyDtoDAsync, each checked. `library`: the
    loaded libcuda, or any object with those three functions (tests)."""

    def __init__(self, library):
        self.library = library
        handle, size = ctypes.c_void_p, ctypes.c_size_t
        signatures = {"cuEventRecord": (handle, handle),
                      "cuStreamWaitEvent": (handle, handle, ctypes.c_uint),
                      "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, size, handle)}
        for name, argtypes in signatures.items():
            function = getattr(library, name)
            if isinstance(function, ctypes._CFuncPtr):
                function.argtypes, function.restype = argtypes, ctypes.c_int
        self._record = library.cuEventRecord
        self._wait = library.cuStreamWaitEvent
        self._copy = library.cuMemcpyDtoDAsync_v2
        # looked up apart: a test's stand-in library need not have it
        self._write_value = getattr(library, "cuStreamWriteValue32_v2", None)
        if isinstance(self._write_value, ctypes._CFuncPtr):
            self._write_value.argtypes = (handle, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
            self._write_value.restype = ctypes.c_int

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != SUCCESS:
            raise DriverError(f"infini_dist: {what} failed with CUDA driver error {result}")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        self._check(self._wait(stream, event, 0), "cuStreamWaitEvent")

    def copy(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        self._check(self._copy(destination, source, nbytes, stream), "cuMemcpyDtoDAsync")

    def write_value(self, stream: int, address: int, value: int) -> None:
        """Once the stream's earlier work is done and visible, the int32 at `address` (any
        device's, where this one can reach it) becomes `value`."""
        self._check(self._write_value(stream, address, value, 0), "cuStreamWriteValue32")


@functools.cache
def driver() -> Driver | None:
    """The process's Driver, or None without libcuda."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def event_handle(device: torch.device) -> tuple[torch.cuda.Event, int]:
    """A new event and its raw handle. torch makes an event at its first record, so it is
    recorded once here, on the device's current stream (where nothing waits for it)."""
    event = torch.cuda.Event()
    with torch.cuda.device(device):
        event.record()
    return event, event.cuda_event


def raw_stream(device_index: int) -> int:
    """The current stream of device `device_index`, as the driver's handle."""
    return torch._C._cuda_getCurrentRawStream(device_index)
