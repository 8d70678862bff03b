"""Where a training step's GPU time goes: plain torch.compile against compile with the pass.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m infini_dist.launch.profile_train --tokens 2048 --out prof_out

Per variant of --variants among inductor, infini_dist, infini_dist_wgrad and collective_free
(AdamW foreach):
bench_train's step (after --warmup steps), then a torch.profiler trace of --prof-steps steps
on rank 0 (--gpu-only: the device alone, on every rank), summarised as GPU time per kernel
category, NCCL time hidden under compute (overlap), the device's idle gaps charged to the host
ranges that launched late, each step's forward + backward and optimizer time on the device
(--head-start-ms: each traced step behind a sleep that long, the host ahead of the device), and
each site's candidate timings and decision. Traces go to --out (gzipped).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import time

import torch
import torch.distributed as dist

from infini_dist.launch import collective_free, shutdown
from infini_dist.launch.job import setup
from infini_dist.launch.bench_train import (FLOOR, WGRAD, TrainDecoder, decide_then_recompile,
                                            parse_args as train_args, train_curve)
from infini_dist.launch.step_timing import sleep_cycles_for

CATEGORIES = (  # first match wins
    ("nccl", re.compile(r"nccl", re.I)),
    ("ours", re.compile(r"all_reduce_kernel|lamport|polled_gather|two_shot|one_shot|"
                        r"ninetoothed|application", re.I)),
    ("inductor", re.compile(r"^triton_")),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|fill|cat|index", re.I)),
)


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if pattern.search(name)), "other")


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _covered(interval, merged) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)


def device_work(trace: dict) -> list:
    """The trace's kernels, copies and memsets, in start order."""
    return sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
                   and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def summarise(trace: dict, steps: int) -> dict:
    kernels = device_work(trace)
    per_cat: dict = {}
    top: dict = {}
    for e in kernels:
        cat = "copy" if e["cat"] != "kernel" else category(e["name"])
        per_cat[cat] = per_cat.get(cat, 0.0) + e["dur"]
        key = (cat, e["name"][:70])
        top[key] = top.get(key, 0.0) + e["dur"]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if category(e["name"]) == "nccl"]
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels
                      if category(e["name"]) != "nccl"])
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) \
        if kernels else 0.0
    streams = sorted({e.get("args", {}).get("stream") for e in kernels
                      if category(e["name"]) == "nccl"} - {None})
    return {"us_per_step": {c: t / steps for c, t in sorted(per_cat.items())},
            "nccl_us": sum(b - a for a, b in nccl) / steps,
            "nccl_hidden_us": sum(_covered(i, compute) for i in nccl) / steps,
            "busy_us": sum(b - a for a, b in busy) / steps, "span_us": span / steps,
            "nccl_streams": streams,
            "top": [(c, n, t / steps) for (c, n), t in
                    sorted(top.items(), key=lambda kv: -kv[1])[:14]]}


def idle_gaps(trace: dict, steps: int, min_us: float = 5.0, top: int = 12) -> dict:
    """Where the device sat idle, and what the host was doing then: each gap of at least
    min_us between busy stretches is charged to the kernel that ends it, named by the host
    ranges open when that kernel was launched (the outermost annotation and the innermost op
    on the launching thread). A gap the host causes shows up under the op that launched late."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = device_work(trace)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    ranges: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ranges.setdefault((e["pid"], e["tid"]), []).append(e)
    charged: dict = {}
    end = None
    for k in kernels:
        if end is not None and k["ts"] - end >= min_us:
            launch = launches.get(k.get("args", {}).get("correlation"))
            label = ("?", k["name"][:50])
            if launch is not None:
                open_ = sorted((r for r in ranges.get((launch["pid"], launch["tid"]), ())
                                if r["ts"] <= launch["ts"]
                                and r["ts"] + r["dur"] >= launch["ts"] + launch["dur"]),
                               key=lambda r: r["ts"])
                if open_:
                    label = (open_[0]["name"][:50], open_[-1]["name"][:50])
            gap = k["ts"] - end
            total, count = charged.get(label, (0.0, 0))
            charged[label] = (total + gap, count + 1)
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    idle = sum(t for t, _ in charged.values())
    return {"idle_us": idle / steps,
            "gaps": [(outer, inner, t / steps, n / steps) for (outer, inner), (t, n) in
                     sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]]}


MARK = "spin_kernel"  # torch.cuda._sleep's kernel: each traced step starts with one


def device_phases(trace: dict) -> list:
    """Per traced step, µs on the device: (forward + backward, the optimizer), from the step's
    first kernel after its mark to the optimizer's first kernel (foreach AdamW's
    multi_tensor_apply), and from there to the step's last kernel."""
    kernels = device_work(trace)
    marks = [i for i, e in enumerate(kernels) if MARK in e["name"]] + [len(kernels)]
    phases = []
    for begin, stop in zip(marks, marks[1:]):
        step = kernels[begin + 1:stop]
        first = next((i for i, e in enumerate(step) if "multi_tensor_apply" in e["name"]), None)
        if not first:
            continue
        end = max(e["ts"] + e["dur"] for e in step[first:])
        phases.append((round(step[first]["ts"] - step[0]["ts"]),
                       round(end - step[first]["ts"])))
    return phases


def profile_variant(variant, args, device, dtype, control, out):
    import infini_dist
    types = infini_dist.config.custom_op_fusion_types
    with infini_dist.config.patch(custom_op_fusion_types=types + ("overlap",) * (
            variant == WGRAD)):
        return _profile(variant, args, device, dtype, control, out)


def _profile(variant, args, device, dtype, control, out):
    import infini_dist.compile as idc
    torch._dynamo.reset()
    model = TrainDecoder(args.model, dist.group.WORLD, device, dtype)
    if variant == "inductor":
        forward = torch.compile(model)
    elif variant == FLOOR:
        forward = collective_free.compile_model(model, collective_free.CollectiveFree())
    else:
        forward, _ = decide_then_recompile(model, args.tokens[0], args, device, dtype, control)
    row = train_curve(model, forward, args.tokens[0], "foreach", args, device, dtype, control)
    x = torch.randn(1, args.tokens[0], args.model.hidden, device=device).to(dtype)
    target = torch.randn(1, args.tokens[0], args.model.hidden, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # --gpu-only: no host ranges recorded, so the host runs at about its unprofiled speed
    acts = [torch.profiler.ProfilerActivity.CPU] * (not args.gpu_only)
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    walls = []
    # --head-start-ms: each traced step behind a sleep that long, so the trace shows the
    # device's own timeline (the host ahead of it), else a 1-cycle mark
    sleep = sleep_cycles_for(args.head_start_ms * 1e-3, device)[0] \
        if args.head_start_ms and device.type == "cuda" else 1
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.prof_steps):
            start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda._sleep(sleep)  # the step's mark in the trace (device_phases)
            loss = torch.nn.functional.mse_loss(forward(x).float(), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            float(loss.detach())  # syncs the device
            walls.append((time.perf_counter() - start) * 1e3)
    result = {"step_ms": row["step_ms"], "traced_step_ms": [round(w, 2) for w in walls]}
    if dist.get_rank() == 0 or args.gpu_only:
        rank = f"_rank{dist.get_rank()}" * args.gpu_only
        path = os.path.join(out, f"trace_{variant}{rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            g.write(f.read())
        os.remove(path)
        result.update(summarise(trace, args.prof_steps))
        result.update(idle_gaps(trace, args.prof_steps), device_phases=device_phases(trace))
        if variant not in ("inductor", FLOOR):
            result["sites"] = [{"op": d["op"], "choice": d["choice"],
                                "outputs": json.loads(d["subgraph"])["outputs"],
                                "times_us": {n: round(t * 1e6, 1) for n, t in
                                             sorted(d.get("times_s", {}).items(),
                                                    key=lambda kv: kv[1])}}
                               for d in idc.decisions()]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prof-steps", type=int, default=3)
    parser.add_argument("--gpu-only", action="store_true",
                        help="trace the device only, on every rank (no host ranges)")
    known, rest = parser.parse_known_args(argv)
    args = train_args(rest)
    args.prof_steps, args.gpu_only = known.prof_steps, known.gpu_only
    device, dtype, control = setup(args)
    os.makedirs(args.out, exist_ok=True)
    results = {v: profile_variant(v, args, device, dtype, control, args.out)
               for v in args.variants if v in ("inductor", "infini_dist", WGRAD, FLOOR)}
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(results, f, indent=1)
        seen = set()
        for v, r in results.items():
            for site in r.get("sites", []):
                key = (site["op"], site["choice"], tuple(site["times_us"].items())[:3])
                if key not in seen:
                    seen.add(key)
                    print(f"site {site['op']} {site['outputs']} -> {site['choice']}: "
                          f"{site['times_us']}")
        for v, r in results.items():
            print(f"\n[{v}] top kernels (us/step):")
            for c, n, t in r["top"]:
                print(f"  {c:9s} {t:8.1f}  {n}")
        for v, r in results.items():
            print(f"\n[{v}] device idle {r['idle_us']:.0f} us/step; the gaps by the host "
                  "ranges open at the launch that ended them (us/step, gaps/step):")
            for outer, inner, t, n in r["gaps"]:
                print(f"  {t:8.1f} {n:6.1f}  {outer} > {inner}")
        for v, r in results.items():
            print(f"[{v}] traced steps, ms: {r['traced_step_ms']}; on the device, "
                  f"(forward + backward, optimizer) us: {r['device_phases']}")
        cats = sorted({c for r in results.values() for c in r["us_per_step"]})
        print("\n| variant | step ms | " + " | ".join(cats) +
              " | busy us | span us | nccl us | nccl hidden us |")
        for v, r in results.items():
            print(f"| {v} | {r['step_ms']:.2f} | " +
                  " | ".join(f"{r['us_per_step'].get(c, 0):.0f}" for c in cats) +
                  f" | {r['busy_us']:.0f} | {r['span_us']:.0f} | {r['nccl_us']:.0f} | "
                  f"{r['nccl_hidden_us']:.0f} |")
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
