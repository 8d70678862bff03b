"""`bench_generate`'s report: its runs (one result per route and round, from fresh processes)
summed up per route, the table, and what is wrong with them."""

from __future__ import annotations

import statistics

VARIANTS = ("plain", "enable", "compile_config", "eager")
COMPILED = ("plain", "enable", "compile_config")
WITH_PASS = ("enable", "compile_config")


def first_divergence(tokens, reference) -> int | None:
    """The first generated step (0-based) at which any sequence of the batch differs; None if
    all are the same."""
    steps = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b),
                  None if len(x) == len(y) else min(len(x), len(y)))
             for x, y in zip(tokens, reference)]
    found = [s for s in steps if s is not None]
    return min(found) if found else None


def summarize(runs: dict) -> list[dict]:
    """One row per variant from its runs (variant -> results in round order): tokens/s median and
    spread over processes, and its tokens against the reference, plain's first good run (so
    plain's later rounds check that a fresh process makes the same tokens)."""
    reference = next((r["tokens"] for v in ("plain", *runs) for r in runs.get(v, [])
                      if "error" not in r), None)
    rows = []
    for variant, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row = {"variant": variant, "runs": len(results), "failed": len(results) - len(ok),
               "bad_exits": sum(1 for r in ok if r.get("exit_status", 0))}
        if ok:
            rates = [r["tokens_per_s"] for r in ok]
            row.update(tokens_per_s=statistics.median(rates), min=min(rates), max=max(rates),
                       step_ms=statistics.median(r["step_ms"] for r in ok),
                       e2e_tokens_per_s=statistics.median(r["e2e_tokens_per_s"] for r in ok),
                       sites=max(r["sites"] for r in ok),
                       pass_ran=all(r["pass_ran"] for r in ok),
                       compiled=all(r["dynamo_graphs"] > 0 for r in ok),
                       timing_graphs=max(r["timing_graphs"] for r in ok),
                       cudagraphs=all(r["cudagraphs"] for r in ok),
                       ranks_agree=all(r["ranks_agree"] for r in ok))
        found = [d for d in (first_divergence(r["tokens"], reference) for r in ok)
                 if d is not None]
        row["compared"] = len(ok) if reference is not None else 0
        row["first_divergence"] = min(found) if found else None
        rows.append(row)
    return rows


def table(rows: list[dict], new_tokens: int) -> list[str]:
    lines = ["| variant | runs | tokens/s median (min-max) | ms/token | e2e tokens/s | compiled | "
             "sites | cudagraphs | tokens vs plain |", "|" + "---|" * 9]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['variant']} | {r['runs']} | all failed |" + " |" * 6)
            continue
        runs = f"{r['runs']} ({r['failed']} failed)" if r["failed"] else r["runs"]
        same = "-" if not r["compared"] else "same" if r["first_divergence"] is None \
            else f"first differs at step {r['first_divergence']} of {new_tokens}"
        yes = {True: "yes", False: "no"}
        lines.append(
            f"| {r['variant']} | {runs} | {r['tokens_per_s']:.1f} ({r['min']:.1f}-{r['max']:.1f})"
            f" | {r['step_ms']:.2f} | {r['e2e_tokens_per_s']:.1f} | {yes[r['compiled']]} | "
            f"{r['sites']} | {yes[r['cudagraphs']]} | {same} |")
    return lines


def verdict(rows: list[dict], fp32: bool) -> list[str]:
    """What is wrong with the runs (empty: nothing). bf16 divergence is reported, not wrong:
    the fused kernels round differently, and greedy decoding amplifies a flipped argmax."""
    problems = [f"{r['variant']}: {r['failed']} run(s) failed" for r in rows if r["failed"]]
    problems += [f"{r['variant']}: {r['bad_exits']} job(s) wrote results, then exited non-zero"
                 for r in rows if r["bad_exits"]]
    for r in (r for r in rows if "tokens_per_s" in r):
        compiled = r["variant"] in COMPILED
        if compiled != r["compiled"]:
            problems.append(f"{r['variant']}: {'not ' if compiled else ''}compiled")
        if r["variant"] in WITH_PASS and not r["pass_ran"]:
            problems.append(f"{r['variant']}: the pass made no site")
        if r["timing_graphs"]:
            problems.append(f"{r['variant']}: compiled again during the timed calls")
        if not r["ranks_agree"]:
            problems.append(f"{r['variant']}: ranks made different tokens")
        if fp32 and r["first_divergence"] is not None:
            problems.append(f"{r['variant']}: tokens differ from plain's at step "
                            f"{r['first_divergence']}")
    # Speed counts on GPUs (not the fp32 CPU smoke, whose host costs are not the product's), with
    # at least two processes a side: one process cannot show the spread.
    problems += [f"{r['variant']}: slower than plain in every process ({r['max']:.1f} tokens/s "
                 f"at best, plain {plain['min']:.1f} at worst)"
                 for plain, r in _against_plain(rows) if not fp32 and _apart(plain, r) == "slower"
                 and min(plain["runs"] - plain["failed"], r["runs"] - r["failed"]) >= 2]
    return problems


def _against_plain(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(plain's row, a pass route's row) for each pass route that has timings, where plain has."""
    plain = next((r for r in rows if r["variant"] == "plain" and "tokens_per_s" in r), None)
    return [] if plain is None else [(plain, r) for r in rows
                                     if r["variant"] in WITH_PASS and "tokens_per_s" in r]


def _apart(plain: dict, row: dict) -> str | None:
    """"faster" or "slower" where every process of `row` is, against every one of plain's."""
    return "faster" if row["min"] > plain["max"] else "slower" if row["max"] < plain["min"] \
        else None


def speed(rows: list[dict]) -> str:
    """Each pass route's tokens/s against plain's, and whether the processes' spreads separate
    them: a host-bound loop moves by more between processes than the sites can change."""
    parts = []
    for plain, r in _against_plain(rows):
        ratio = r["tokens_per_s"] / plain["tokens_per_s"]
        order = _apart(plain, r)
        apart = f"{order} in every process" if order else "within the spread of the processes"
        parts.append(f"{r['variant']} {ratio:.2f}x plain's median, {apart}")
    return "; ".join(parts)
