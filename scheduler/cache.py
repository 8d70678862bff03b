"""The decision cache: in-process, plus one JSON file per key on disk.

Only rank 0 of a group touches the disk; it broadcasts what it found, so every rank agrees on hit
or miss even when their file systems differ. Writes are atomic (temp file + rename).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import warnings
from pathlib import Path

import torch

log = logging.getLogger("infini_dist")

CACHE_FORMAT = 1


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
        path = self.path(cache_dir, key)
        if not path.exists():
            return None
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict) or not isinstance(record.get("choice"), str):
                raise ValueError("record has no 'choice'")
        except (OSError, ValueError) as error:
            warnings.warn(f"infini_dist: ignoring corrupt cache file {path} ({error}); it will be "
                          f"rebuilt", RuntimeWarning, stacklevel=2)
            return None
        if record.get("versions") != versions():
            warnings.warn(f"infini_dist: ignoring cache file {path} written by other versions "
                          f"{record.get('versions')}; it will be rebuilt", RuntimeWarning,
                          stacklevel=2)
            return None
        return record

    def write_disk(self, cache_dir, key: str, record: dict) -> None:
        path = self.path(cache_dir, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(dict(record, versions=versions()), f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as error:
            # A read-only cache dir must not break the job: the decision still lives in memory.
            warnings.warn(f"infini_dist: could not write cache file {path}: {error}",
                          RuntimeWarning, stacklevel=2)


DECISIONS = DecisionCache()
