"""Tuning says what it did: one line per tuned site, on rank 0 only (the caller checks the rank).

While a warm-up progress bar is up the line goes through tqdm (so the bar stays whole); else to
the `infini_dist` logger at INFO, or to stderr where logging is not configured at all (Python
would drop an INFO record then, and a model tuning for seconds in silence looks hung).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("infini_dist")

progress_bar = None  # the warm-up's tqdm bar while it runs (infini_dist.warmup sets it)


def tuned(line: str, loud: bool = False) -> None:
    if progress_bar is not None:
        progress_bar.write(line, file=progress_bar.fp)
    elif loud:
        log.warning(line)
    elif log.hasHandlers():
        log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)
