"""Tables, verdict and plot of the model benchmark (`launch/bench_model.py`), from its rows."""

from __future__ import annotations

VARIANTS = ("inductor", "infini_dist", "eager")
SPEEDUP_TARGET, TARGET_MAX_BATCH = 1.15, 16
PREFILL_TARGET = 1.3  # with config.matmul_prologue (issue 14); without it, prefill: not slower


def summarize(decisions: list[dict]) -> list[dict]:
    from infini_dist.scheduler.ir import subgraph_from_text
    rows = []
    for d in decisions:
        outputs = len(subgraph_from_text(d["subgraph"]).output_names)
        rows.append({"site": f"{d['op']} ({outputs} out)", "choice": d.get("choice"),
                     "source": d.get("source"),
                     "times_us": {k: v * 1e6 for k, v in (d.get("times_s") or {}).items()}})
    return rows



def _cell(row, key, fmt):
    if row is None:
        return "-"
    if "error" in row:
        return "error"
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def summary(rows, shapes, args, smoke: bool, target_speedup: float = SPEEDUP_TARGET,
            target_max_batch: int = TARGET_MAX_BATCH) -> tuple[list[str], dict]:
    by = {(r["shape"], r["variant"]): r for r in rows}
    lines, verdict = [], {"target_misses": [], "check_failures": []}
    head = (f"{'shape':>14s} {'inductor':>10s} {'+infini':>10s} {'eager':>10s} {'b/a':>6s} "
            f"{'sites':>5s} {'relL2 b-c':>10s} {'relL2 a-c':>10s}  committed")
    lines += ["", "summary (us per step, median, max over ranks; b/a = speed-up of infini_dist "
              "over inductor)", head]
    for shape in shapes:
        a, b, c = (by.get((shape.name, v)) for v in VARIANTS)
        speedup = None
        if a and b and a.get("median_us") and b.get("median_us"):
            speedup = a["median_us"] / b["median_us"]
            target = target_speedup if shape.kind == "decode" and \
                shape.batch <= target_max_batch else 1.0
            if shape.kind == "prefill":
                target = getattr(args, "prefill_target", 1.0)
            if speedup < target:
                verdict["target_misses"].append(f"{shape.name}: {speedup:.2f}x < {target}x")
        elif a is not None and b is not None:
            verdict["target_misses"].append(f"{shape.name}: no speed-up (an error above)")
        if b is not None and "infini_dist" in args.variants and "eager" in args.variants:
            error = b.get("rel_l2_vs_eager")
            if error is None or not error <= args.tol:
                verdict["check_failures"].append(
                    f"{shape.name}: " + ("not checked (an error above)" if error is None
                                         else f"rel L2 {error:.2e} > {args.tol:g}"))
        chosen = sorted({d["choice"] for d in (b or {}).get("decisions", [])})
        lines.append(f"{shape.name:>14s} {_cell(a, 'median_us', '.1f'):>10s} "
                     f"{_cell(b, 'median_us', '.1f'):>10s} {_cell(c, 'median_us', '.1f'):>10s} "
                     f"{'-' if speedup is None else f'{speedup:.2f}x':>6s} "
                     f"{_cell(b, 'sites', 'd'):>5s} {_cell(b, 'rel_l2_vs_eager', '.2e'):>10s} "
                     f"{_cell(a, 'rel_l2_vs_eager', '.2e'):>10s}  {','.join(chosen) or '-'}")
    where = " (CPU smoke: the timings say nothing about GPUs)" if smoke else ""
    prefill = getattr(args, "prefill_target", 1.0)
    lines.append(f"target: infini_dist >= {target_speedup}x over inductor at decode batch <= "
                 f"{target_max_batch}" + (f", >= {prefill}x at prefill" if prefill > 1 else "")
                 + ", never slower: " + (
                     "met" if not verdict["target_misses"] else
                     "NOT met: " + "; ".join(verdict["target_misses"])) + where)
    lines.append(f"correctness: infini_dist vs eager, relative L2 <= {args.tol:g}: " + (
        "ok" if not verdict["check_failures"] else
        "FAILED: " + "; ".join(verdict["check_failures"])))
    return lines, verdict


def print_details(rows):
    for row in rows:
        if "capture_error" in row:
            print(f"{row['shape']} {row['variant']}: capture failed, timed eagerly: "
                  f"{row['capture_error']}")
        if "error" in row:
            print(f"{row['shape']} {row['variant']}: {row['error']}")
        for message in row.get("infini_dist_warnings", []):
            print(f"{row['shape']} {row['variant']}: infini_dist warned: {message}")
        if row["variant"] == "infini_dist" and "decisions" in row:
            print(f"\n{row['shape']}: infini_dist replaced {row.get('sites')} site(s) in "
                  f"{row.get('pass_graphs')} graph(s)")
            for d in row["decisions"]:
                times = ", ".join(f"{n} {t:.1f}" for n, t in sorted(d["times_us"].items(),
                                                                    key=lambda kv: kv[1]))
                print(f"  {d['site']}: committed {d['choice']} ({d['source']})"
                      + (f"; us: {times}" if times else ""))


def plot(rows, shapes, path, title: str = "TP decoder step latency") -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return False
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(shapes), 4.5))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        values = [next((r.get("median_us") for r in rows if r["shape"] == s.name
                        and r["variant"] == variant), None) for s in shapes]
        xs = [j + i * width for j, v in enumerate(values) if v]
        ax.bar(xs, [v for v in values if v], width, label=variant)
    ax.set_xticks([j + width for j in range(len(shapes))], [s.name for s in shapes])
    ax.set_yscale("log")
    ax.set_ylabel("us per step (median, max over ranks)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
