"""First-time work of a site (tuning, symmetric buffers and their rendezvous, compiles, the
first run of the committed choice) on a thread and stream of its own.

Why: torch.compile's CUDA-graph trees (mode="reduce-overhead", "max-autotune") run each new
graph's first call as a warm-up in which every CUDA allocation *of the calling thread* goes to the
graph's private memory pool (torch >= 2.8, `_cuda_beginAllocateCurrentThreadToPool`; older torch
routed the calling stream). A tensor that outlives the warm-up there and is not a graph output
(a buffer's address table, a kept view of an input) is reported as "Detected N tensor(s) in the
cudagraph pool not tracked as outputs", and the tree is broken for every model of the process.
Work handed to `run_aside` runs on a fresh thread, on a stream that is not the caller's, so its
allocations land in the ordinary pool under either rule; nothing it keeps can be a pool tensor.

The caller blocks until the work is done, so ranks stay in lockstep exactly as before.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def run_aside(fn: Callable[[], T], device: torch.device) -> T:
    """fn() on a fresh thread: on `device` (CUDA) and a side stream that starts after the
    caller's current stream and that the caller's stream waits for afterwards; with the caller's
    inference mode and no autograd recording. Exceptions propagate to the caller."""
    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    inference = torch.is_inference_mode_enabled()

    def work():
        with contextlib.ExitStack() as stack:
            # Grad mode and the device are per thread; tuning never needs autograd.
            stack.enter_context(torch.inference_mode() if inference else torch.no_grad())
            if caller is None:
                return fn()
            stack.enter_context(torch.cuda.device(device))
            side = torch.cuda.Stream(device=device)
            side.wait_stream(caller)  # the inputs were written on the caller's stream
            stack.enter_context(torch.cuda.stream(side))
            try:
                return fn()
            finally:
                # Later work on the caller's stream (freeing the inputs, reusing a symmetric
                # buffer) must come after everything done here.
                caller.wait_stream(side)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="infini_dist-setup") as pool:
        return pool.submit(work).result()
