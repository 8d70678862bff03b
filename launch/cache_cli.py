"""`infini-dist cache list | show KEY | clear [KEY ...]`: see and manage the decisions on disk.

Works on the configured cache dir (`config.cache_dir`, `INFINI_DIST_CACHE_DIR`) or `--cache-dir`;
no torchrun. KEY is a key or any unique prefix of one (list shows 12 characters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infini_dist.scheduler.cache import read_record, versions


def _records(cache_dir: Path) -> list[tuple[str, dict | None]]:
    """(key, record or None where the file is unreadable), by key. Read as the engine reads
    them: a FIFO, a directory or deep JSON named like a record is unreadable, never a hang."""
    rows = []
    for path in sorted(cache_dir.glob("*.json")):
        try:
            record = read_record(path)
        except Exception:  # noqa: BLE001 - RecursionError from deep JSON too
            record = None
        rows.append((path.stem, record))
    return rows


def _op_chain(record: dict) -> str:
    if "op" in record:
        return record["op"]
    try:  # records written before the field: the op chain is in the subgraph text
        return "+".join(node[0] for node in json.loads(record["subgraph"])["nodes"])
    except (KeyError, ValueError, TypeError, IndexError):
        return "?"


def _row(key: str, record: dict | None, current: dict) -> list[str]:
    if record is None:
        return [key[:12], "(unreadable)"] + [""] * 7
    times = record.get("times_s") or {}
    best = times.get(record.get("choice"))
    found = record.get("versions") or {}
    stale = "" if found == current else " (stale)"
    return [key[:12], _op_chain(record), str(record.get("bucket", "-")),
            "/".join(record.get("dtypes", [])) or "-", str(record.get("choice")),
            f"{best * 1e6:.1f}" if isinstance(best, (int, float)) else "-",
            str(record.get("world_size", "-")), str(record.get("device", "-")),
            f"{found.get('infini_dist', '?')}/torch {found.get('torch', '?')}{stale}"]


def _table(rows: list[list[str]]) -> str:
    header = ["key", "op", "bucket", "dtypes", "choice", "us", "world", "device", "versions"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in [header] + rows)


def _match(keys: list[str], prefix: str) -> list[str]:
    return [k for k in keys if k.startswith(prefix)]


def add_arguments(parser):
    import infini_dist
    cache_dir = dict(help=f"default: config.cache_dir ({infini_dist.config.cache_dir})")
    parser.add_argument("--cache-dir", default=None, **cache_dir)
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="one line per decision")
    show = sub.add_parser("show", help="print one decision's JSON record")
    show.add_argument("key")
    clear = sub.add_parser("clear", help="remove decisions: the given keys, or all")
    clear.add_argument("keys", nargs="*")
    # after the action too; SUPPRESS: where it is not given there, the one before it stays
    for action in (listing, show, clear):
        action.add_argument("--cache-dir", default=argparse.SUPPRESS, **cache_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="infini-dist cache",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    import infini_dist
    cache_dir = Path(args.cache_dir or infini_dist.config.cache_dir).expanduser()
    records = _records(cache_dir) if cache_dir.is_dir() else []
    keys = [k for k, _ in records]

    if args.action == "list":
        if not records:
            print(f"no decisions in {cache_dir}")
            return 0
        current = versions()
        print(_table([_row(k, r, current) for k, r in records]))
        print(f"{len(records)} decision(s) in {cache_dir}")
        return 0
    if args.action == "show":
        found = _match(keys, args.key)
        if len(found) != 1:
            print(f"infini-dist cache show: {args.key!r} matches {len(found)} decisions in "
                  f"{cache_dir}" + (f": {', '.join(k[:12] for k in found)}" if found else ""),
                  file=sys.stderr)
            return 2
        record = dict(records)[found[0]]
        if record is None:
            print(f"infini-dist cache show: {found[0]} is unreadable", file=sys.stderr)
            return 2
        print(json.dumps(record, indent=1, sort_keys=True))  # as write_disk wrote it
        return 0
    chosen = keys
    if args.keys:
        unknown = [p for p in args.keys if not _match(keys, p)]
        if unknown:  # nothing removed: a typo must not half-clear
            print(f"infini-dist cache clear: no decision matches {unknown} in {cache_dir}",
                  file=sys.stderr)
            return 2
        chosen = sorted({k for p in args.keys for k in _match(keys, p)})
    for key in chosen:
        (cache_dir / f"{key}.json").unlink(missing_ok=True)
    print(f"removed {len(chosen)} decision(s) from {cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
