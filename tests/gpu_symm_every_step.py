"""Every chain step and every norm of the op specs through each symmetric-memory kernel's plain
callable, on real GPUs, at any world size (one GPU is enough):

    torchrun --standalone --nproc-per-node=1 tests/gpu_symm_every_step.py [KERNEL ...]

The Triton interpreter on the CPU runs the generated per-spec device code, but only the GPU
compiler shows what it rejects or miscompiles, and the engine offers these kernels only from two
GPUs up. Here each step (symm_chain.STEPS) and each norm (symm_chain.NORM_CODES) is compiled and
run in every kernel, in fp32 and bf16, against a float64 reference of the summed inputs; at two
ranks and more the outputs must also be bitwise equal across ranks. Each output quantizer
(symm_chain.QUANT_CODES) is compared dequantized, within e4m3's precision. Prints 'ALL OK' last.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("INFINI_DIST_SYMM_TIMEOUT_S", "60")  # a lost peer traps, never hangs

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from infini_dist.kernels import symm_call  # noqa: E402
from infini_dist.kernels.epilogue import SPECS  # noqa: E402
from infini_dist.kernels.symm_chain import NORM_CODES, QUANT_CODES, STEPS  # noqa: E402
from symm_cases import callable_quant  # noqa: E402
from infini_dist.kernels.lamport_one_shot import lamport_one_shot_all_reduce  # noqa: E402
from infini_dist.kernels.lamport_one_shot_streamed import \
    lamport_one_shot_streamed_all_reduce  # noqa: E402
from infini_dist.kernels.lamport_two_shot import lamport_two_shot_all_reduce  # noqa: E402
from infini_dist.kernels.one_shot_all_reduce import one_shot_all_reduce  # noqa: E402
from infini_dist.kernels.two_shot_all_reduce import two_shot_all_reduce  # noqa: E402
from infini_dist.kernels.two_shot_polled_gather import \
    two_shot_polled_gather_all_reduce  # noqa: E402

KERNELS = {"one_shot": one_shot_all_reduce, "two_shot": two_shot_all_reduce,
           "two_shot_polled_gather": two_shot_polled_gather_all_reduce,
           "lamport_one_shot": lamport_one_shot_all_reduce,
           "lamport_two_shot": lamport_two_shot_all_reduce,
           "lamport_one_shot_streamed": lamport_one_shot_streamed_all_reduce}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
QUANT_TOLERANCE = 6e-2  # e4m3 keeps 3 mantissa bits: one rounding is up to 6.25% of a value
QUANT_SCALE = 0.05      # a static scale under which no value here reaches the clamp at 448

# float64 references of the steps, (value, operand) -> value; a step missing here fails the run,
# so a new spec'd step cannot go unchecked.
STEP_REFERENCES = {
    "relu": lambda y, _: y.clamp_min(0), "scale": lambda y, s: y * s,
    "silu": lambda y, _: F.silu(y), "sigmoid": lambda y, _: torch.sigmoid(y),
    "gelu": lambda y, _: F.gelu(y), "gelu_tanh": lambda y, _: F.gelu(y, approximate="tanh"),
    "mul": lambda y, s: y * s, "add": lambda y, s: y + s, "bias_add": lambda y, b: y + b,
    "swiglu_gate": lambda y, s: F.silu(y) * s, "swiglu_up": lambda y, s: F.silu(s) * y,
}


# The output quantizers' results dequantized, (results, static scale) -> results with the value
# in its input's units (float64), compared with a float64 reference of the unquantized value;
# a quantizer missing here fails the run.
DEQUANTIZE = {
    "quant_fp8": lambda got, scale: (got[0].double() * scale,) + got[1:],
    "quant_fp8_tensor_scale": lambda got, scale: (got[0].double() * float(scale),) + got[1:],
    "quant_fp8_per_token": lambda got, _: (got[0].double() * got[1].double(),) + got[2:],
    "quant_fp8_per_token_reciprocal":
        lambda got, _: (got[0].double() * got[1].double(),) + got[2:],
}


def _rms(y, eps):
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)


def _layer_norm(y, w, b, eps):
    return F.layer_norm(y, y.shape[-1:], w, b, eps)


NORM_REFERENCES = {
    "rms_norm": lambda y, w, b, eps: _rms(y, eps) * w,
    "gemma_rms_norm": lambda y, w, b, eps: _rms(y, eps) * (1 + w),
    "layer_norm": _layer_norm,
    "layer_norm_no_bias": _layer_norm,  # its bias is None
}


def operand(name, x, generator):
    """The step's operand on every rank alike: a scalar, a row tensor or a last-dim vector."""
    side = STEPS[name].side
    if STEPS[name].scalar is not None:
        return 0.75
    shape = x.shape[-1:] if side == "vector" else x.shape
    if side is None:
        return None
    return torch.randn(shape, generator=generator, device=x.device).to(x.dtype)


def cases(x, generator):
    """(label, callable kwargs, reference of the summed fp64 value) per step and per norm."""
    for name in sorted(STEPS):
        if name not in STEP_REFERENCES:
            raise AssertionError(f"no float64 reference for chain step {name!r}")
        value = operand(name, x, generator)
        step = (name,) if value is None else (name, value)
        ref = STEP_REFERENCES[name]
        other = value.double() if isinstance(value, torch.Tensor) else value
        yield (f"epilogue {name}", dict(epilogue=(step,)), lambda y, r=ref, o=other: r(y, o))
    for name in sorted(NORM_CODES):
        if name not in symm_call._NORM_ROLES:
            continue  # residual forms: rms_norm with `residual` below
        if name not in NORM_REFERENCES:
            raise AssertionError(f"no float64 reference for norm {name!r}")
        n = x.shape[-1]
        weight = (1 + 0.1 * torch.randn(n, generator=generator, device=x.device)).to(x.dtype)
        bias = None
        if "bias" in symm_call._NORM_ROLES[name]:
            bias = torch.randn(n, generator=generator, device=x.device).to(x.dtype)
        residual = torch.randn(x.shape, generator=generator, device=x.device).to(x.dtype)
        ref = NORM_REFERENCES[name]
        w64, b64 = weight.double(), None if bias is None else bias.double()
        kw = dict(norm=name, weight=weight, bias=bias, eps=1e-5)
        yield (f"norm {name}", kw, lambda y, r=ref: r(y, w64, b64, 1e-5))
        yield (f"residual + relu + norm {name}", dict(kw, residual=residual, epilogue=(("relu",),)),
               lambda y, r=ref, res=residual.double(): (r(y.clamp_min(0) + res, w64, b64, 1e-5),
                                                        y.clamp_min(0) + res))
    yield from quant_cases(x, generator)


def quant_cases(x, generator):
    """Each output quantizer after residual + rms_norm (the FP8 output beside the residual) and,
    where it needs no row, after a silu chain; compared dequantized (DEQUANTIZE)."""
    for name in sorted(QUANT_CODES):
        if name not in DEQUANTIZE:
            raise AssertionError(f"no dequantizer for output quantizer {name!r}")
        quant = callable_quant(name, QUANT_SCALE, x.device)
        weight = (1 + 0.1 * torch.randn(x.shape[-1], generator=generator, device=x.device))
        residual = torch.randn(x.shape, generator=generator, device=x.device).to(x.dtype)
        w64, res = weight.to(x.dtype).double(), residual.double()
        yield (f"residual + rms_norm + {name}",
               dict(weight=weight.to(x.dtype), residual=residual, eps=1e-5, quant=quant),
               lambda y, w=w64, r=res: (_rms(y + r, 1e-5) * w, y + r))
        if not SPECS[name].symm_quant.row_scale:
            yield (f"epilogue silu + {name}", dict(epilogue=(("silu",),), quant=quant),
                   lambda y: F.silu(y))


def main(names) -> int:
    """`names`: the kernels to check (all when empty); the test runs one per process, so their
    compiles, most of the time here, run side by side."""
    unknown = set(names) - set(KERNELS)
    if unknown:
        raise SystemExit(f"unknown kernels {sorted(unknown)}: known are {sorted(KERNELS)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    failures = []
    # each (dtype, shape) compiles every kernel once per case: two pairs keep it near 2 minutes
    for dtype, shape in ((torch.float32, (3, 4096)), (torch.bfloat16, (5, 1000))):
        for kernel_name, kernel in KERNELS.items():
            if names and kernel_name not in names:
                continue
            same = torch.Generator(device="cuda").manual_seed(7)
            inputs = [torch.randn(shape, generator=torch.Generator(device="cuda")
                                  .manual_seed(100 + r), device="cuda").to(dtype)
                      for r in range(world)]
            total = sum(t.double() for t in inputs)
            for label, kwargs, reference in cases(inputs[0], same):
                what = f"{kernel_name} {dtype} {shape} {label}"
                try:
                    got = kernel(inputs[rank], **kwargs)
                    torch.cuda.synchronize()
                except Exception as error:  # report every case, not the first only
                    message = f"{type(error).__name__}: {error}"
                    if not any(f.startswith(kernel_name) for f in failures):
                        print(f"rank {rank} first failure of {what}:\n{message}", flush=True)
                    failures.append(f"{what}: {message.splitlines()[-1][:300]}")
                    continue
                got = got if isinstance(got, tuple) else (got,)
                want = reference(total)
                want = want if isinstance(want, tuple) else (want,)
                quant = kwargs.get("quant")
                values = DEQUANTIZE[quant[0]](got, quant[1:] and quant[1]) if quant else got
                for i, (g, w) in enumerate(zip(values, want)):
                    err = float((g.double() - w).norm() / w.norm().clamp_min(1e-12))
                    if not err <= (QUANT_TOLERANCE if quant and i == 0 else TOLERANCE[dtype]):
                        failures.append(f"{what}: relative error {err:.3g}")
                for g in got if world > 1 else ():
                    g = g.contiguous().view(torch.uint8)  # fp8 too, as bytes
                    gathered = [torch.empty_like(g) for _ in range(world)]
                    dist.all_gather(gathered, g)
                    if any(not torch.equal(gathered[0], other) for other in gathered):
                        failures.append(f"{what}: ranks differ")
    for failure in failures:
        print(f"rank {rank} FAIL {failure}", flush=True)
    print(f"rank {rank}: {len(failures)} failure(s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not failures:
        print("ALL OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
