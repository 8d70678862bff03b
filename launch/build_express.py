"""Build the eager ops' C++ module now (`infini-dist build`), so the fast path serves from the
first call instead of after a background build; prints where it went and what it cost."""

from __future__ import annotations

import sys
import time


def main() -> int:
    from infini_dist.kernels import express
    started = time.monotonic()
    try:
        built = express.build()
    except Exception as error:  # the eager ops will take the Python path; say why
        print(f"infini-dist build: failed after {time.monotonic() - started:.1f} s: "
              f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"infini-dist build: {built.__name__} ready in {time.monotonic() - started:.1f} s "
          f"({getattr(built, '__file__', '?')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
