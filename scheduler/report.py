"""Tuning says what it did: one line per tuned site, on rank 0 only (the caller checks the rank).

The line goes to the `infini_dist` logger at INFO, or where logging is not configured at all,
to stderr through tqdm.write (Python would drop an INFO record then, and a model tuning for
seconds in silence looks hung; tqdm.write keeps the warm-up's progress bar whole). Configured
logging is the user's: its handlers decide where the line goes.
"""

from __future__ import annotations

import logging
import sys

import torch

log = logging.getLogger("infini_dist")


def tuned(line: str, loud: bool = False) -> None:
    if not log.hasHandlers():
        from tqdm import tqdm
        tqdm.write(line, file=sys.stderr)  # what logging's last resort does for a warning too
    elif loud:
        log.warning(line)
    else:
        log.info(line)


def tuned_site(record: dict, key: str, loud: bool, announce: bool) -> None:
    """A site's tuning outcome: one line where `announce` (one rank of the group says it), and
    every choice's time at debug level."""
    times = record["times_s"]
    if announce:
        bucket = f" tokens<={record['bucket']}" if record["bucket"] else ""
        tuned(f"infini_dist: tuned {record['op']}{bucket} {'/'.join(record['dtypes'])} -> "
              f"{record['choice']} {times[record['choice']] * 1e6:.1f}us "
              f"({len(record['candidates'])} choices, {record['tuning_s']:.2f}s, {key[:12]})",
              loud=loud)
    log.debug("infini_dist: timings for %s: %s", key[:12],
              ", ".join(f"{n}={t * 1e6:.1f}us" for n, t in sorted(times.items(),
                                                                   key=lambda x: x[1])))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def describe(sub, values: dict, bucket: int | None, ctx) -> dict:
    """What a decision record says of its site, for `infini-dist cache list`."""
    tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
    return {"op": "+".join(n.op_type for n in sub.nodes), "bucket": bucket,
            "shapes": [list(t.shape) for t in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "world_size": ctx.world_size, "device": device_name(ctx.device)}
