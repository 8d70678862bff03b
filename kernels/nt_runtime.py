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
"""

from __future__ import annotations

import os
import threading
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
