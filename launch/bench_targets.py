"""What `infini-dist bench` (launch/bench.py) reads off its rows: the engine against the user's
own path, against the fastest all-reduce that does no epilogue, against FlashInfer, and the FP8
epilogues' cost. Each is a list of `pattern/tokens ratio` strings for the summary lines."""

from __future__ import annotations

import json

# The all-reduces that do no epilogue, as the sweep and its peers name their rows.
AR_ALONE = ("nccl_ar", "nccl_symm_ar", "symm_two_shot_ar", "symm_one_shot_ar")


def above_native(rows, noise: float) -> list[dict]:
    """Every (pattern, tokens, mode) where the engine row is slower than the native row by more
    than the fraction `noise`: the engine can always commit native, so each is a finding."""
    found = []
    by_case = {(r["pattern"], r["tokens"], r["impl"]): r for r in rows}
    for (pattern, tokens, impl), row in by_case.items():
        native = by_case.get((pattern, tokens, "native"))
        if impl != "engine" or native is None:
            continue
        for mode in ("graph", "eager"):
            mine, theirs = row.get(f"{mode}_us"), native.get(f"{mode}_us")
            if mine is not None and theirs is not None and mine > theirs * (1 + noise):
                found.append({"pattern": pattern, "tokens": tokens, "mode": mode,
                              "engine_us": mine, "native_us": theirs})
    return found


def _engine_over(rows, mode, theirs) -> list[tuple[str, float]]:
    """Per engine row: (pattern/tokens, its time over the fastest row of the same case that
    `theirs(impl)` accepts); below 1, the engine is faster."""
    out = []
    for row in rows:
        mine = row.get(f"{mode}_us")
        if row["impl"] != "engine" or mine is None:
            continue
        others = [r[f"{mode}_us"] for r in rows if theirs(r["impl"])
                  and (r["pattern"], r["tokens"]) == (row["pattern"], row["tokens"])
                  and r.get(f"{mode}_us") is not None]
        if others:
            out.append((f"{row['pattern']}/{row['tokens']}", mine / min(others)))
    return out


def engine_vs_ar_alone(rows, mode="graph") -> list[str]:
    """The engine's time over the fastest all-reduce alone of the same case (target: <= 1)."""
    return [f"{case} {ratio:.2f}" for case, ratio in
            _engine_over(rows, mode, lambda impl: impl in AR_ALONE)]


def engine_vs_flashinfer(rows, mode="graph") -> list[str]:
    """How many times faster the engine row is than the fastest FlashInfer row of the same case
    (target: >= 1.2 at <= 128 tokens)."""
    return [f"{case} {1 / ratio:.2f}x" for case, ratio in
            _engine_over(rows, mode, lambda impl: impl.startswith("fi_"))]


def fp8_cost(rows, mode) -> list[str]:
    """Per FP8 pattern and token count, the engine's time over its time for the same count
    without the quantization (the target: at most 1.05)."""
    engine = {(r["pattern"], r["tokens"]): r.get(f"{mode}_us") for r in rows
              if r["impl"] == "engine"}
    out = []
    for (pattern, tokens), us in engine.items():
        base = engine.get(("add_rms_norm", tokens))
        if pattern.startswith("add_rms_norm_fp8") and us and base:
            out.append(f"{pattern}/{tokens} {us / base:.3f}")
    return out


def extra_rows(paths, patterns, tokens, graph_calls: int = 1) -> list[dict]:
    """The rows of other processes' results.json files, for this sweep's cases only. A file
    timed with another number of calls per CUDA graph (meta `graph_calls`, 1 where absent) is
    left out, with a line saying so: its graph rows would not compare with this sweep's."""
    rows = []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        theirs = result.get("meta", {}).get("graph_calls", 1)
        if theirs != graph_calls:
            print(f"extra rows of {path} left out: timed with {theirs} call(s) a CUDA graph, "
                  f"this sweep with {graph_calls}", flush=True)
            continue
        rows += [r for r in result["rows"] if r["pattern"] in patterns and r["tokens"] in tokens]
    return rows
