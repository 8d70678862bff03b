"""The decision cache: in-process, plus one JSON file per key on disk.

Only rank 0 of a group touches the disk; it broadcasts what it found, so every rank agrees on hit
or miss even when their file systems differ. Writes are atomic (temp file + rename), and no
content or file type at a record's path can crash or block a read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path

import torch

log = logging.getLogger("infini_dist")

# 2: a compiled site's partial-epilogue choices are timed with their rest compiled by Inductor
# (scheduler/native_inductor.py); decisions timed with it in eager torch are not reused.
CACHE_FORMAT = 2


def versions() -> dict[str, str]:
    from infini_dist import __version__
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "infini_dist": __version__,
            "format": str(CACHE_FORMAT)}


class DecisionCache:
    def __init__(self):
        self._memory: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_memory(self, key: str) -> dict | None:
        with self._lock:
            return self._memory.get(key)

    def put_memory(self, key: str, record: dict) -> None:
        with self._lock:
            self._memory[key] = record

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def clear(self) -> None:
        with self._lock:
            self._memory.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._memory)

    # --- disk (rank 0 only) ---
    @staticmethod
    def path(cache_dir: str | os.PathLike, key: str) -> Path:
        return Path(cache_dir).expanduser() / f"{key}.json"

    def read_disk(self, cache_dir, key: str) -> dict | None:
        """The record on disk, or None. Never raises and never blocks: a file of any content or
        type (a directory, a FIFO, deep JSON) is warned about and treated as a miss."""
        path = self.path(cache_dir, key)
        try:
            record = read_record(path)
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001 - RecursionError from deep JSON too
            _warn(f"ignoring unusable cache file {path} ({type(error).__name__}: {error}); the "
                  f"decision is tuned again and rewritten")
            return None
        if record.get("versions") != versions():
            _warn(f"ignoring cache file {path} written by other versions "
                  f"{record.get('versions')}; it will be rebuilt")
            return None
        return record

    def write_disk(self, cache_dir, key: str, record: dict) -> None:
        """Atomic (temp file + rename); any failure is a warning, and leaves no temp file."""
        path = self.path(cache_dir, key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(dict(record, versions=versions()), f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            tmp = None
        except Exception as error:  # noqa: BLE001 - the decision still lives in memory
            _warn(f"could not write cache file {path} ({type(error).__name__}: {error}); "
                  f"running with the in-memory decision")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


MAX_RECORD_BYTES = 1 << 20  # a record is a few kB; anything larger is not ours


def read_record(path: Path) -> dict:
    """A decision record from `path`; raises on anything that is not one. Never blocks."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it anyway.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
    record = json.loads(data.decode("utf-8"))
    if not isinstance(record, dict) or not isinstance(record.get("choice"), str):
        raise ValueError("record has no 'choice'")
    return record


def _warn(message: str) -> None:
    warnings.warn(f"infini_dist: {message}", RuntimeWarning, stacklevel=3)


def __getattr__(name):
    # The tuned records belong to the engine's one store (scheduler/store.py); `DECISIONS` is
    # their old name, kept for callers that count hits and misses.
    if name == "DECISIONS":
        from infini_dist.scheduler.store import STORE
        return STORE.records
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
