"""The eager ops' per-call path in C++ (express.cpp): a committed launch matched and made
without Python.

An eager op's Python path (checks, the executor lookup, the site's decision lookup, the
prepared launch, two `empty_like`s, Triton's launcher with ~45 arguments) costs more host time
than a bare NCCL all_reduce. Once a call has gone that way and ended in a FastLaunch whose
per-call tensors are the op's inputs and fresh outputs, its launch is recorded here: the
kernel's function handle, grid and parameters as the driver takes them, which parameters are
the op's tensors, and the exact layout those tensors had. Later calls with the same op, group,
scalar and layouts are matched in C++, which allocates the outputs and calls cuLaunchKernelEx
on the current stream (with programmatic dependent launch for a kernel compiled with
launch_pdl): what Triton's launcher does for the same arguments, without the Python.

The parameters are packed from the compiled kernel's signature (constexprs dropped, tuples
flattened, pointers as addresses), and a record is made only when the packing agrees with the
parameter sizes the driver reports (cuFuncGetParamInfo): the 0-2 trailing parameters Triton
adds for its scratch memory must be the only difference, and the kernel must need no scratch.
Anything else (the interpreter, hooks, scratch, clusters, another Triton) makes no record, and
the Python path stays. The module is compiled once per machine (torch.utils.cpp_extension, in
a background thread, so no rank stalls a collective on the compiler; `infini-dist build` does
it ahead of time); until it is ready, or where it cannot be built, there simply are no records.
It includes only Python.h (it reads tensors through their attributes, and `bind` hands it
torch's types and callables), so that compile takes about 2 s, not the 11-14 s that ATen's and
pybind11's headers cost: a fresh machine's eager calls take the Python path only that long.
Builders take an flock, which dies with its holder, so a killed build never blocks a later one
(torch's own lock file, which a killed builder leaves behind, would make the next wait forever).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import inspect
import logging
import os
import struct
import sys
import threading
import time

import torch

log = logging.getLogger("infini_dist")

BUILD_TIMEOUT_S = 900.0  # a compile on a loaded machine; past it, the Python path stays
MAX_RECORDS = 8192  # a serving job's token counts: one record per exact shape (~1 KB each)
_INT_SIZES = {"i1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8,
              "u64": 8}
_state = {"module": None, "thread": None, "error": None, "cleared": 0}
_lock = threading.Lock()


NAME = "infini_dist_express"


def build_directory() -> str:
    """Where the module is built: one folder per Python and torch, so a machine's builds for
    other versions never collide (INFINI_DIST_EXPRESS_DIR moves the root)."""
    root = os.environ.get("INFINI_DIST_EXPRESS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "infini_dist", "express")
    version = f"py{sys.version_info[0]}{sys.version_info[1]}_torch{torch.__version__}"
    return os.path.join(root, version.replace("+", "_"), NAME)


@contextlib.contextmanager
def _build_lock(directory: str, timeout_s: float):
    """Held while this process builds or loads the module. An flock, not torch's lock file:
    the kernel drops it when its holder dies, so a killed builder never blocks the next one.
    Under it, torch's own lock file (`lock`, created by cpp_extension and left behind by a
    builder that was killed) can only be stale, so it is removed."""
    os.makedirs(directory, exist_ok=True)
    with open(directory + ".flock", "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held the build lock of {directory} "
                                       f"for over {timeout_s:.0f} s") from None
                time.sleep(0.2)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):
                log.warning("infini_dist: removed %s, left by a build that was killed", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cuda_here() -> bool:
    """Whether this machine serves eager calls from the module (CUDA tensors)."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def build(timeout_s: float | None = None):
    """Build (or load the cached build of) the C++ module in this thread and return it, bound
    to torch. Raises where it cannot be built here (no compiler, no Python headers, another
    builder holding the lock past `timeout_s`)."""
    from torch.utils import cpp_extension
    directory = build_directory()
    with _build_lock(directory, BUILD_TIMEOUT_S if timeout_s is None else timeout_s):
        built = cpp_extension.load(
            name=NAME, sources=[os.path.join(os.path.dirname(__file__), "express.cpp")],
            extra_cflags=["-O2"], with_cuda=False, build_directory=directory, verbose=False)
    device = getattr(torch._C, "_cuda_getDevice", None)
    stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    cuda = device is not None and stream is not None
    built.bind(torch.Tensor, torch.nn.Parameter, torch.empty, torch.empty_like,
               torch.is_grad_enabled, device if cuda else None, stream if cuda else None)
    return built


def start(wait: bool = False):
    """Build (or load the cached build of) the C++ module in a background thread, once;
    `wait`: block until it is done. Returns the module, or None while it is not ready or
    where it cannot be built (then one warning says why, and the Python path serves)."""
    state = _state  # the build reports to the state it was started for, and only to it
    with _lock:
        if state["thread"] is None:
            def run():
                try:
                    state["module"] = build()
                except Exception as error:  # no compiler, no headers, a lock held too long
                    state["error"] = error
                    log.warning("infini_dist: the eager ops take the Python path: their C++ "
                                "module could not be built (%s: %s)", type(error).__name__,
                                str(error).strip().splitlines()[-1][:300] if str(error) else "")
            state["thread"] = threading.Thread(target=run, name="infini_dist-express",
                                               daemon=True)
            state["thread"].start()
    if wait:
        state["thread"].join()
    return state["module"]


def module():
    """The built module, or None (not built yet, or not buildable here)."""
    return _state["module"]


def clear() -> None:
    """Forget every record: the config or an op's definition changed."""
    _state["cleared"] += 1
    built = _state["module"]
    if built is not None:
        built.clear()


def cleared() -> int:
    """How many times the records were forgotten (whoever remembers what it offered resets)."""
    return _state["cleared"]


class _Slot:  # a per-call tensor's place among a FastLaunch's arguments
    def __init__(self, index: int):
        self.index = index


def pack(compiled, launch) -> tuple[list, list] | None:
    """(cells, slots) of `launch` (an nt_runtime.FastLaunch) for its compiled kernel: one
    8-byte cell per kernel parameter (little-endian: a smaller value in its low bytes), and
    (cell, per-call tensor index) for every parameter that is a per-call tensor. None where
    the signature has a type this packing does not know."""
    signature = compiled.src.signature
    names = list(inspect.signature(launch.kernel.fn).parameters)
    values = launch._fill([_Slot(i) for i in range(launch.count)])
    cells, slots, sizes = [], [], []

    def add(value, kind) -> bool:
        if kind == "constexpr":
            return True
        if isinstance(kind, tuple):
            return (isinstance(value, tuple) and len(value) == len(kind)
                    and all(add(v, k) for v, k in zip(value, kind)))
        if kind.startswith("*"):
            if isinstance(value, _Slot):
                slots.append((len(cells), value.index))
                cells.append(0)
            elif isinstance(value, torch.Tensor):
                cells.append(value.data_ptr())
            else:
                return False
        elif kind in _INT_SIZES:
            cells.append(int(value) & ((1 << 64) - 1))
        elif kind in ("fp32", "f32"):
            cells.append(struct.unpack("<I", struct.pack("<f", float(value)))[0])
        elif kind == "fp64":
            cells.append(struct.unpack("<Q", struct.pack("<d", float(value)))[0])
        else:
            return False
        sizes.append(_INT_SIZES.get(kind, 8 if kind.startswith("*") or kind == "fp64" else 4))
        return True

    for name, value in zip(names, values):
        if name not in signature or not add(value, signature[name]):
            return None
    return cells, slots, sizes


def _hooked() -> bool:
    """Whether Triton's launch hooks are set (a chain of them counts when it holds any)."""
    try:
        import triton
        hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    except AttributeError:
        return False
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def launch_record(launch) -> dict | None:
    """What express.cpp needs to make `launch` (a FastLaunch on its short path): function,
    grid, threads, shared memory and the packed parameters; None where it cannot be made
    without Triton's launcher."""
    built, compiled = _state["module"], getattr(launch, "compiled", None)
    if built is None or compiled is None or not launch.fast:
        return None
    metadata = compiled.metadata
    if _hooked():
        return None  # a profiler's hooks run in Triton's launcher only
    if (getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0)
            or getattr(metadata, "num_ctas", 1) != 1
            or getattr(metadata, "launch_cooperative_grid", False)
            or tuple(getattr(metadata, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) not in
            ((1, 1, 1), (0, 0, 0))):
        return None
    packed = pack(compiled, launch)
    if packed is None:
        return None
    cells, slots, sizes = packed
    driver = list(built.param_sizes(compiled.function))
    extra = len(driver) - len(sizes)
    if driver[:len(sizes)] != sizes or not 0 <= extra <= 2 or driver[len(sizes):] != [8] * extra:
        return None  # not the ABI this packing assumes: Triton's own launcher stays
    return dict(function=compiled.function, grid=list(launch.grid),
                threads=32 * metadata.num_warps, shared=metadata.shared,
                cells=cells + [0] * extra, slots=slots,
                pdl=bool(getattr(metadata, "launch_pdl", False)))


def add(op: int, group, scalar: float, device: int, inputs: list, outputs: list,
        returned: list, record: dict, aligned: list, keep=None) -> bool:
    """Record one committed launch: `keep`, what owns its buffers and kernel (held while
    recorded), `inputs`, the op's tensors (their layouts are matched),
    `outputs`, tensors like those each call allocates, `returned`, indices into `outputs` in
    the op's order, `record` from launch_record with its slots counted over inputs, then
    outputs. False where the table is full."""
    built = _state["module"]
    if built is None or built.size() >= MAX_RECORDS:
        return False
    if len(record["grid"]) != 3:  # the module checks the slots' and returned's ranges itself
        raise ValueError(f"grid: 3 ints, got {record['grid']!r}")
    layouts = [(tuple(t.shape), tuple(t.stride()), t.dtype, bool(a))
               for t, a in zip(inputs, aligned, strict=True)]
    first = inputs[0]
    made = [(tuple(t.shape), t.dtype, t.device, first.is_contiguous() and t.shape == first.shape
             and t.dtype is first.dtype and t.device == first.device) for t in outputs]
    built.add(op, group, keep, float(scalar), device, layouts, made,
              array.array("i", returned).tobytes(), record["function"], tuple(record["grid"]),
              record["threads"], record["shared"], array.array("Q", record["cells"]).tobytes(),
              array.array("i", [i for pair in record["slots"] for i in pair]).tobytes(),
              bool(record.get("pdl", False)))
    return True
