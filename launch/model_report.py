"""Tables, verdict and plot of the model benchmarks (`launch/bench_model.py`,
`launch/bench_hf.py`), from their rows."""

from __future__ import annotations

from dataclasses import dataclass

FLOOR = "collective_free"  # the compiled step with no-op collectives (launch/collective_free.py)
VARIANTS = ("inductor", "infini_dist", FLOOR, "eager")
SPEEDUP_TARGET, TARGET_MAX_BATCH = 1.15, 16
PREFILL_TARGET = 1.3  # with config.matmul_prologue (issue 14); without it, prefill: not slower


@dataclass(frozen=True)
class Target:
    """The speed a run is reported against (never enforced). At decode batch <= max_batch:
    infini_dist >= `speedup` x plain (inductor), or where `floor_ratio` is set, infini_dist's
    step <= floor_ratio x the collective-free step; at prefill >= `prefill` x plain; elsewhere
    never slower than plain."""
    max_batch: int
    speedup: float = 1.0
    floor_ratio: float | None = None
    prefill: float = 1.0

    def text(self) -> str:
        decode = (f"infini_dist <= {self.floor_ratio}x the {FLOOR} step" if self.floor_ratio
                  else f"infini_dist >= {self.speedup}x over inductor")
        prefill = f", >= {self.prefill}x at prefill" if self.prefill > 1 else ""
        return f"{decode} at decode batch <= {self.max_batch}{prefill}, never slower than inductor"


def summarize(decisions: list[dict]) -> list[dict]:
    from infini_dist.scheduler.ir import subgraph_from_text
    rows = []
    for d in decisions:
        outputs = len(subgraph_from_text(d["subgraph"]).output_names)
        rows.append({"site": f"{d['op']} ({outputs} out)", "choice": d.get("choice"),
                     "source": d.get("source"),
                     "times_us": {k: v * 1e6 for k, v in (d.get("times_s") or {}).items()}})
    return rows


def add_floor_ratios(rows) -> None:
    """Each compiled row's step over the collective-free step of its shape (`over_floor`), and
    the same of the steps as the device alone made them where they were timed so
    (`over_floor_device`, from `device_us`)."""
    for key, ratio in (("median_us", "over_floor"), ("device_us", "over_floor_device")):
        floors = {(r.get("family"), r["shape"]): r.get(key) for r in rows
                  if r["variant"] == FLOOR}
        for row in rows:
            floor = floors.get((row.get("family"), row["shape"]))
            if floor and row.get(key) and row["variant"] in ("inductor", "infini_dist"):
                row[ratio] = row[key] / floor


def _floor_check(row) -> str | None:
    """Why the collective-free row of a shape is no floor (None: it is one)."""
    if row is None or "error" in row:
        return None  # not run, or its error is in the table
    if row.get("collectives_left") != 0 or not row.get("collectives_removed"):
        return (f"{FLOOR} is no floor: {row.get('collectives_removed')} collective(s) replaced, "
                f"{row.get('collectives_left')} left in its graphs")
    return None


def cell(row, key, fmt) -> str:
    """row[key] formatted; "-" where there is no row or value, "error" for a failed row."""
    if row is None:
        return "-"
    if "error" in row:
        return "error"
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def _against_floor(shape, target: Target) -> bool:
    """Whether `target` judges `shape` against the collective-free step (else against plain)."""
    return shape.kind == "decode" and shape.batch <= target.max_batch and bool(target.floor_ratio)


def _speed_miss(shape, a, b, f, target: Target, device: bool = False) -> str | None:
    """The shape's miss of `target` (None: met, or nothing to compare). `device`: judged on the
    steps as the device alone made them (`device_us`, `over_floor_device`)."""
    if a is None or b is None:
        return None
    key, ratio = ("device_us", "over_floor_device") if device else ("median_us", "over_floor")
    if not (a.get(key) and b.get(key)):
        return f"{shape.name}: no speed-up (an error above)"
    speedup = a[key] / b[key]
    decode = shape.kind == "decode" and shape.batch <= target.max_batch
    if _against_floor(shape, target):
        over = b.get(ratio)
        if over is None:
            return f"{shape.name}: no {FLOOR} step to compare with" + (
                " (an error above)" if f is not None else "")
        plain = a.get(ratio)
        return None if over <= target.floor_ratio else \
            f"{shape.name}: {over:.3f}x the {FLOOR} step > {target.floor_ratio}x" + (
                "" if plain is None else f" (inductor {plain:.3f}x)")
    goal = target.speedup if decode else target.prefill if shape.kind == "prefill" else 1.0
    return None if speedup >= goal else f"{shape.name}: {speedup:.2f}x < {goal}x"


def _device_lines(by, shapes, target: Target) -> tuple[list[str], list[str]]:
    """The steps as the device alone made them (step_timing.time_device), per shape the pass's
    and plain's over the floor's, and the target judged on them; ([], []) where none were. A
    shape whose compared variants were not all timed so (a variant whose calls wait for the
    device) is named as not judged: neither met nor missed."""
    cells, misses, unjudged = [], [], []
    for shape in shapes:
        a, b, f = (by.get((shape.name, v)) for v in VARIANTS[:3])
        if not (b or {}).get("device_us"):
            continue
        cells.append(f"{shape.name} {cell(b, 'over_floor_device', '.3f')} (inductor "
                     f"{cell(a, 'over_floor_device', '.3f')}; {b['device_us']:.1f} us)")
        compared = (b, f) if _against_floor(shape, target) else (a, b)
        if not all((r or {}).get("device_us") for r in compared):
            unjudged.append(shape.name)
            continue
        misses += [m for m in [_speed_miss(shape, a, b, f, target, device=True)] if m]
    if not cells:
        return [], []
    verdict = [] if len(unjudged) == len(cells) else \
        ["met" if not misses else "NOT met: " + "; ".join(misses)]
    if unjudged:
        verdict.append(f"not judged (a variant's calls waited for the device): "
                       f"{', '.join(unjudged)}")
    verdict = "; ".join(verdict)
    return [f"device-only step (host kept ahead; b/f): {'; '.join(cells)}",
            f"target on the device-only step: {verdict}"], misses


def summary(rows, shapes, args, smoke: bool, target: Target | None = None
            ) -> tuple[list[str], dict]:
    """The short table (one line per shape), the floor, target and correctness lines, and the
    verdict. Default target: bench_model's (>= 1.15x at decode batch <= 16, --matmul-prologue's
    prefill target from args.prefill_target)."""
    target = target or Target(TARGET_MAX_BATCH, SPEEDUP_TARGET,
                              prefill=getattr(args, "prefill_target", 1.0))
    by = {(r["shape"], r["variant"]): r for r in rows}
    lines, misses, wrong, no_floor = [], [], [], []
    head = (f"{'shape':>14s} {'inductor':>10s} {'+infini':>10s} {'floor':>10s} {'eager':>10s} "
            f"{'b/a':>6s} {'b/f':>6s} {'a/f':>6s} {'sites':>5s} {'relL2 b-c':>10s} "
            f"{'relL2 a-c':>10s}  committed")
    lines += ["", "summary (us per step, median, max over ranks; b/a = speed-up of infini_dist "
              f"over inductor; floor = the {FLOOR} step, b/f and a/f = infini_dist's and "
              "inductor's step over it)", head]
    removed, floors = 0, 0
    for shape in shapes:
        a, b, f, c = (by.get((shape.name, v)) for v in VARIANTS)
        misses += [m for m in [_speed_miss(shape, a, b, f, target)] if m]
        if b is not None and "infini_dist" in args.variants and "eager" in args.variants:
            error = b.get("rel_l2_vs_eager")
            if error is None or not error <= args.tol:
                wrong.append(f"{shape.name}: " + ("not checked (an error above)" if error is None
                                                  else f"rel L2 {error:.2e} > {args.tol:g}"))
        no_floor += [f"{shape.name}: {m}" for m in [_floor_check(f)] if m]
        removed += (f or {}).get("collectives_removed") or 0
        floors += f is not None
        speedup = a["median_us"] / b["median_us"] if a and b and a.get("median_us") \
            and b.get("median_us") else None
        chosen = sorted({d["choice"] for d in (b or {}).get("decisions", [])})
        lines.append(f"{shape.name:>14s} {cell(a, 'median_us', '.1f'):>10s} "
                     f"{cell(b, 'median_us', '.1f'):>10s} {cell(f, 'median_us', '.1f'):>10s} "
                     f"{cell(c, 'median_us', '.1f'):>10s} "
                     f"{'-' if speedup is None else f'{speedup:.2f}x':>6s} "
                     f"{cell(b, 'over_floor', '.3f'):>6s} {cell(a, 'over_floor', '.3f'):>6s} "
                     f"{cell(b, 'sites', 'd'):>5s} {cell(b, 'rel_l2_vs_eager', '.2e'):>10s} "
                     f"{cell(a, 'rel_l2_vs_eager', '.2e'):>10s}  {','.join(chosen) or '-'}")
    if floors:
        lines.append(f"floor: {FLOOR} = the same compile, every collective a no-op (its output "
                     f"is not checked): " + ("; ".join(no_floor) if no_floor else
                                             f"{removed} collective(s) replaced, none left"))
    where = " (CPU smoke: the timings say nothing about GPUs)" if smoke else ""
    lines.append(f"target: {target.text()}: " + (
        "met" if not misses else "NOT met: " + "; ".join(misses)) + where)
    device_lines, device_misses = _device_lines(by, shapes, target)
    lines += device_lines
    lines.append(f"correctness: infini_dist vs eager, relative L2 <= {args.tol:g}: " + (
        "ok" if not wrong else "FAILED: " + "; ".join(wrong)))
    # A floor that kept a collective is a bench bug: it fails the run as a wrong output does.
    return lines, {"target_misses": misses, "device_target_misses": device_misses,
                   "check_failures": wrong + no_floor}


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
            for chain in row.get("chains", []):
                print("  " + chain_line(chain))


def chain_line(chain: dict) -> str:
    """A row-split chain's decision (infini_dist.compile.chain_decisions()), in one line."""
    if "totals_s" not in chain:
        return (f"row-split chain of {chain.get('sites')} sites: {chain.get('mode')} "
                f"({chain.get('reason', 'not decided')})")
    totals = chain["totals_s"]
    units = "; ".join(f"site {u['site']} x{u['count']}: " + ", ".join(
        f"{n} {t * 1e6:.1f}" for n, t in u["times_s"].items()) + f" -> {u['split']}"
        for u in chain["units"])
    return (f"row-split chain of {chain['sites']} sites at {chain['rows']} rows: committed "
            f"{chain['mode']} (split {totals['split'] * 1e6:.1f} us against site by site "
            f"{totals['sites'] * 1e6:.1f} us; {units})")


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
