"""The eager ops' add + RMSNorm backward on one GPU: the fused kernel (kernels/rms_norm_backward)
against the torch ops it replaced and against Inductor compiling those same ops.

    python -m infini_dist.launch.bench_norm_backward --rows 1,128,2048,8192 --hidden 4096

µs per call (triton.testing.do_bench, median), bf16, random data; GB/s counts the bytes the
backward must move (h, grad_out, grad_h read, dh written; the weight and its gradient are small).
Every variant is checked against float64 autograd first.
"""

from __future__ import annotations

import argparse

import torch

from infini_dist.kernels.rms_norm_backward import rms_norm_backward
from infini_dist.scheduler.backward import add_rms_norm_backward_torch as unfused


def _error(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,128,2048,8192")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    from triton.testing import do_bench
    dtype = getattr(torch, args.dtype)
    compiled = torch.compile(unfused, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, hidden {args.hidden}")
    print("| rows | torch ops µs | Inductor µs | fused kernel µs | kernel GB/s | speed-up vs "
          "best | rel. error dh / dw (kernel) |")
    print("|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(rows)
        shape = (rows, args.hidden)
        h = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.3).to(dtype)
        w = (torch.rand(args.hidden, device="cuda", generator=g) + 0.5).to(dtype)
        dy, dres = (torch.randn(shape, device="cuda", generator=g).to(dtype) for _ in range(2))
        h64 = h.double().requires_grad_()
        w64 = w.double().requires_grad_()
        out = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
        ref = torch.autograd.grad((out * dy.double()).sum() + (h64 * dres.double()).sum(),
                                  (h64, w64))
        times, errors = {}, {}
        for name, fn in (("torch", unfused), ("inductor", compiled),
                         ("kernel", lambda *a: rms_norm_backward(*a))):
            dh, dw = fn(h, w, dy, dres, 1e-6)
            errors[name] = (_error(dh, ref[0]), _error(dw, ref[1]))
            times[name] = do_bench(lambda: fn(h, w, dy, dres, 1e-6), warmup=25, rep=200,
                                   return_mode="median") * 1e3
        moved = 4 * h.numel() * h.element_size()
        best = min(times["torch"], times["inductor"])
        print(f"| {rows} | {times['torch']:.1f} | {times['inductor']:.1f} | "
              f"{times['kernel']:.1f} | {moved / times['kernel'] / 1e3:.0f} | "
              f"{best / times['kernel']:.2f}x | {errors['kernel'][0]:.1e} / "
              f"{errors['kernel'][1]:.1e} |")
        for name, (e_dh, e_dw) in errors.items():
            if not (e_dh < 2e-2 and e_dw < 2e-2):
                raise SystemExit(f"{name} at {rows} rows: relative error {e_dh:.2e} / {e_dw:.2e}")


if __name__ == "__main__":
    main()
