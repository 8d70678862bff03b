"""Where a training step's GPU time goes: plain torch.compile against compile with the pass.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        -m infini_dist.launch.profile_train --tokens 2048 --out prof_out

Per variant of --variants among inductor, infini_dist and infini_dist_wgrad (AdamW foreach):
bench_train's step (after --warmup steps), then a torch.profiler trace of --prof-steps steps
on rank 0, summarised as GPU time per kernel category, NCCL time hidden under compute
(overlap), and each site's candidate timings and decision. Traces go to --out (gzipped).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re

import torch
import torch.distributed as dist

from infini_dist.launch import shutdown
from infini_dist.launch.bench_model import setup
from infini_dist.launch.bench_train import (WGRAD, TrainDecoder, decide_then_recompile,
                                            parse_args as train_args, train_curve)

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


def summarise(trace: dict, steps: int) -> dict:
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
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
    forward = decide_then_recompile(model, args.tokens[0], args, device, dtype) \
        if variant != "inductor" else torch.compile(model)
    row = train_curve(model, forward, args.tokens[0], "foreach", args, device, dtype, control)
    x = torch.randn(1, args.tokens[0], args.model.hidden, device=device).to(dtype)
    target = torch.randn(1, args.tokens[0], args.model.hidden, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.prof_steps):
            loss = torch.nn.functional.mse_loss(forward(x).float(), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # syncs the device
    result = {"step_ms": row["step_ms"]}
    if dist.get_rank() == 0:
        path = os.path.join(out, f"trace_{variant}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            g.write(f.read())
        os.remove(path)
        result.update(summarise(trace, args.prof_steps))
        if variant != "inductor":
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
    known, rest = parser.parse_known_args(argv)
    args = train_args(rest)
    args.prof_steps = known.prof_steps
    device, dtype, control = setup(args)
    os.makedirs(args.out, exist_ok=True)
    results = {v: profile_variant(v, args, device, dtype, control, args.out)
               for v in args.variants if v in ("inductor", "infini_dist", WGRAD)}
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
