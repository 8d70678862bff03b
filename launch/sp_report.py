"""`bench --sp`'s report (launch/bench_sp.py): each row's ratios to plain compile and to the
collective-free step, the checks that fail the run, and the markdown table."""

from __future__ import annotations

from infini_dist.launch.model_report import FLOOR


def compare(rows: list, tol: float) -> list[str]:
    """Each compiled row's time over inductor's and over the floor's, and what failed."""
    failures = []
    for row in rows:
        same = {r["variant"]: r for r in rows if r["tokens"] == row["tokens"]
                and r["kind"] == row["kind"] and "ms" in r}
        if row["variant"] == FLOOR:
            continue
        for name, key in (("inductor", "over_inductor"), (FLOOR, "over_floor")):
            if "ms" in row and name in same:
                row[key] = row["ms"] / same[name]["ms"]
        if "error" in row:
            failures.append(f"{row['tokens']} {row['kind']} {row['variant']}: {row['error']}")
        elif row.get("rel_l2_vs_eager", 0.0) > tol:
            failures.append(f"{row['tokens']} forward {row['variant']}: rel L2 "
                            f"{row['rel_l2_vs_eager']:.3g} > {tol}")
        elif row["kind"] == "train" and row["variant"] != "inductor" \
                and "losses" in same.get("inductor", {}):
            base = same["inductor"]["losses"]
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], base))
            row["loss_rel_diff"] = diff
            if diff > tol:
                failures.append(f"{row['tokens']} train {row['variant']}: loss curve differs "
                                f"by {diff:.3g} > {tol}")
    return failures


def table(rows: list, force: str | None, eager_timing: bool) -> str:
    marks = [m for m in (force, "eager timing" if eager_timing else None) if m]
    name = f"infini_dist[{', '.join(marks)}]" if marks else "infini_dist"
    lines = ["| tokens | step | variant | ms | host ms | / inductor | / floor "
             "| rel L2 or loss diff | sites | chosen |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shown = r["variant"].replace("infini_dist", name, 1)
        if "ms" not in r:
            lines.append(f"| {r['tokens']} | {r['kind']} | {shown} | {r['error'][:120]} "
                         "| | | | | | |")
            continue
        check = r.get("rel_l2_vs_eager", r.get("loss_rel_diff"))
        ratios = [f"{r[k]:.3f}" if k in r else "" for k in ("over_inductor", "over_floor")]
        host = f"{r['host_ms']:.3f}" if "host_ms" in r else ""
        lines.append(f"| {r['tokens']} | {r['kind']} | {shown} | {r['ms']:.3f} | {host} | "
                     f"{ratios[0]} | {ratios[1]} | "
                     f"{'' if check is None else f'{check:.2e}'} | {r.get('sites', '')} | "
                     f"{' '.join(r.get('chosen', []))} |")
    return "\n".join(lines)
