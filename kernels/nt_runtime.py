"""ninetoothed as our kernels use it: a locked `make`, an atomic source cache, and a CPU stand-in
driver so the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on machines with no GPU.

- `ninetoothed.make` is not thread-safe (it sets `application.__annotations__` and bumps global
  name counters) and the engine precompiles choices in a thread pool, so every make takes a lock.
- ninetoothed writes generated source to ~/.ninetoothed/<sha256>.py with a plain open/write, and
  imports it if the file exists. Ranks sharing a home directory can import a half-written file, so
  `prepare()` swaps in a write-to-temp-then-rename.
- Under TRITON_INTERPRET=1 without a GPU, Triton has no active driver and ninetoothed's code
  generator asks it for device properties; `prepare()` installs `_CpuDriver`.
- `make` takes concrete block sizes: no meta-parameters, so no autotuning (per-rank timing would
  give ranks different kernels, and the interpreter cannot time) and none of the interpreter's
  trouble with `triton.language.constexpr` annotations.

TRITON_INTERPRET must be set before the first kernel is made: Triton reads it when it decorates a
kernel, and the kernel caches keep what was made.

`FastLaunch` (end of the file) launches any Triton kernel, ours or ninetoothed's, with the
per-call host work cut to filling in a few tensors; see its docstring.
"""

from __future__ import annotations

import inspect
import os
import threading
import types
from types import SimpleNamespace

_make_lock = threading.RLock()
_prepared = False

# What an H100/H200 reports; ninetoothed derives its default warps/stages and tile limits from it.
_DEVICE_PROPERTIES = {"max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132,
                      "warpSize": 32}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _CpuDriver:
    """The members of a Triton driver that ninetoothed and the interpreter touch."""

    def __init__(self):
        self.utils = SimpleNamespace(get_device_properties=lambda device: dict(_DEVICE_PROPERTIES))

    @staticmethod
    def is_active():
        return True

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_current_target(self):
        return None


def _atomic_cache_source(generation):
    def cache_source(source):
        import hashlib
        digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
        path = generation.CACHE_DIR / f"{digest}.py"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
            temp.write_text(source, encoding="utf-8")
            os.replace(temp, path)
        return path
    cache_source._infini_dist = True
    return cache_source


def _has_working_driver(triton) -> bool:
    try:
        triton.runtime.driver.active.get_current_device()
        return True
    except Exception:  # noqa: BLE001 - "0 active drivers" and the like
        return False


def prepare() -> None:
    """Install the fixes above. Idempotent and cheap after the first call."""
    global _prepared
    if _prepared:
        return
    with _make_lock:
        if _prepared:
            return
        import ninetoothed.generation as generation
        import triton

        if not getattr(generation.cache_source, "_infini_dist", False):
            generation.cache_source = _atomic_cache_source(generation)
        if interpreting() and not _has_working_driver(triton):
            triton.runtime.driver.set_active(_CpuDriver())
        _prepared = True


def make(premade, num_warps: int, num_stages: int = 1):
    """`ninetoothed.make(*premade)` with fixed launch settings: no autotuning, so every rank runs
    the same configuration (and the interpreter never times candidates)."""
    prepare()
    import ninetoothed
    arrangement, application, tensors = premade
    with _make_lock:
        return ninetoothed.make(arrangement, application, tensors, num_warps=num_warps,
                                num_stages=num_stages)


# ---- launching a Triton kernel with the host path cut short -------------------------------------

_compiled_kernel_type = None


def compiled_kernel_type():
    """Triton's CompiledKernel class when it offers `compiled[grid](*args, stream=)` (Triton 3.6
    and 3.9 both do), else None: then every launch takes the normal path. Looked up once."""
    global _compiled_kernel_type
    if _compiled_kernel_type is None:
        found = False
        if not interpreting():
            try:
                from triton.compiler import CompiledKernel
                found = CompiledKernel if callable(getattr(CompiledKernel, "__getitem__", None)) \
                    else False
            except ImportError:
                pass
        _compiled_kernel_type = found
    return _compiled_kernel_type or None


class FastLaunch:
    """One launch of a Triton kernel whose grid, options and arguments are fixed but for a few
    tensors (the `per_call` ones), which each call passes anew.

    Triton's normal launch (`kernel[grid](...)`) binds every argument, computes its
    specialisation (type, 16-byte alignment, ints equal to 1 or multiples of 16) and a cache
    key, then calls the compiled kernel's launcher: for our ~45-argument kernels that Python
    costs more than the kernels themselves at decode sizes. Here the arguments are bound once,
    into a list in parameter order (what the launcher takes, constexprs included). The first
    call takes the normal path and keeps the CompiledKernel it returns; later calls fill in the
    per-call tensors and call `compiled[grid](*args, stream=)` directly. Such a call would have
    found that same kernel on the normal path only if the specialisation is the same, so a call
    takes the short path only when its per-call tensors have the first call's dtypes and
    16-byte-aligned addresses (everything else is fixed by construction) and the current device
    is the first call's; any other call takes the normal path. Feature detection is once per
    FastLaunch: when the normal path returns no CompiledKernel (the interpreter, another
    Triton), every call stays on the normal path, with the pre-bound arguments.

    What the short path skips: Triton's pre-run hooks (none may be registered, else it is not
    used), its check that the kernel's globals are unchanged, and its re-reading of the debug
    knobs (set them before the first launch). `enabled=False` keeps every call on the normal
    path, for A/B timing.
    """

    def __init__(self, kernel, grid, args, kwargs, per_call, enabled: bool = True):
        signature = inspect.signature(kernel.fn)
        options = {k: v for k, v in kwargs.items() if k not in signature.parameters}
        bound = signature.bind(*args, **{k: v for k, v in kwargs.items()
                                         if k in signature.parameters})
        bound.apply_defaults()
        values = list(bound.arguments.values())
        if callable(grid):
            grid = grid(bound.arguments)
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.options = options
        # (position, index into per_call): every argument that *is* a per-call tensor
        self.slots = tuple((position, index) for position, value in enumerate(values)
                           for index, tensor in enumerate(per_call) if value is tensor)
        for position, _ in self.slots:
            values[position] = None  # keeps no caller tensor alive
        # Tuple arguments (the symm kernels' chains) may hold per-call tensors too:
        # (position, the tuple as a list, ((element, index into per_call), ...)).
        self.nested = []
        for position, value in enumerate(values):
            if isinstance(value, tuple):
                pairs = tuple((element, index) for element, item in enumerate(value)
                              for index, tensor in enumerate(per_call) if item is tensor)
                if pairs:
                    template = [None if any(e == i for e, _ in pairs) else item
                                for i, item in enumerate(value)]
                    self.nested.append((position, template, pairs))
                    values[position] = None  # the template keeps no caller tensor either
        self.args = values
        self.count = len(per_call)
        self._try_fast = enabled  # False: the normal path always (the engine's fast_launch flag)
        self._launcher = None
        self.compiled = None  # the CompiledKernel of the short path (kernels/express.py)
        self._device = None
        self._dtypes = ()
        self._get_device = self._get_stream = None

    @property
    def fast(self) -> bool:
        """Whether calls now take the short path."""
        return self._launcher is not None

    @property
    def normal_only(self) -> bool:
        """Whether every call takes the normal path for good (disabled, or no CompiledKernel)."""
        return self._launcher is None and not self._try_fast

    def _fill(self, tensors) -> list:
        args = self.args.copy()
        for position, index in self.slots:
            args[position] = tensors[index]
        for position, template, pairs in self.nested:
            filled = template.copy()
            for element, index in pairs:
                filled[element] = tensors[index]
            args[position] = tuple(filled)
        return args

    def __call__(self, *tensors, stream=None):
        """Launch on `stream` (a raw handle of the current device's; None: its current
        stream)."""
        launcher = self._launcher
        if launcher is not None and len(tensors) == self.count:
            for tensor, dtype in zip(tensors, self._dtypes):
                if tensor.dtype is not dtype or tensor.data_ptr() % 16:
                    break
            else:
                device = self._get_device()
                if device == self._device:
                    launcher(*self._fill(tensors),
                             stream=self._get_stream(device) if stream is None else stream)
                    return
        import torch
        if stream is None or stream == torch.cuda.current_stream().cuda_stream:
            self._normal(tensors)  # (torch makes ExternalStream(0) a pool stream)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):  # Triton: the current one
            self._normal(tensors)

    def _normal(self, tensors):
        if len(tensors) != self.count:
            raise TypeError(f"this launch takes {self.count} tensors, got {len(tensors)}")
        compiled = self.kernel[self.grid](*self._fill(tensors), **self.options)
        if self._try_fast and self._launcher is None:
            self._adopt(compiled, tensors)

    def _adopt(self, compiled, tensors):
        if any(t.data_ptr() % 16 for t in tensors):
            return  # a specialisation for unaligned tensors: wait for an aligned call
        kind = compiled_kernel_type()
        if (kind is None or not isinstance(compiled, kind)
                or getattr(self.kernel, "pre_run_hooks", None)):
            self._try_fast = False  # the normal path it is, for good
            return
        import triton
        active = triton.runtime.driver.active
        self._get_device = active.get_current_device
        self._get_stream = active.get_current_stream
        self._device = self._get_device()
        self._dtypes = tuple(t.dtype for t in tensors)
        self._launcher = compiled[self.grid]
        self.compiled = compiled


def fast_launch(handle, args, per_call) -> FastLaunch | None:
    """The FastLaunch of `handle(*args)` (`handle` from `make`), with the tensors in
    `per_call` (each its own object, found among `args`) passed anew at every call; None when
    this ninetoothed's handle does not show its Triton kernel and launch function.

    ninetoothed's generated launch function turns every tensor into its pointer, sizes and
    strides and calls `kernel[grid](...)`. It is run once here with the kernel swapped for a
    recorder (in a copy of its globals: the shared module is left alone), and what it would
    pass is what the FastLaunch binds. Sizes and strides are then fixed, so calls must pass
    tensors laid out like `args` (the caller checks shapes and contiguity)."""
    kernel, launch = getattr(handle, "_kernel", None), getattr(handle, "_launch", None)
    code = getattr(launch, "__code__", None)
    if code is None or not hasattr(kernel, "fn"):
        return None
    names = [name for name, value in launch.__globals__.items() if value is kernel]
    if len(names) != 1:
        return None
    recorded = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((grid, args, kwargs))

    replay = types.FunctionType(code, {**launch.__globals__, names[0]: Recorder()}, code.co_name,
                                launch.__defaults__, launch.__closure__)
    replay(*args)
    if len(recorded) != 1:
        return None
    grid, recorded_args, recorded_kwargs = recorded[0]
    if any(hasattr(a, "data_ptr") and not any(a is t for t in per_call) for a in recorded_args):
        return None  # a tensor the launch function made itself would be kept from this call
    return FastLaunch(kernel, grid, recorded_args, recorded_kwargs, per_call)
