"""How the per-kernel tests run a symmetric-memory kernel (tests/test_symm_*.py).

- Interpreted on CPU ranks (`run_interpreted`): Triton's interpreter in W processes whose
  "symmetric" buffers are shared CPU memory, each process addressing its peers through its own
  mapping exactly as on GPUs. Program b of every rank runs in the same order, so the barriers
  work in the interpreter as on the device. Each case goes through the engine's algorithm (from
  the registry) and, for two patterns, through the kernel file's plain callable.
- On GPUs (`run_gpu_worker`): tests/gpu_symm_worker.py under torchrun.

Algorithms are looked up in the engine's registry by the kernel they launch, never by name.
"""

from __future__ import annotations

import os
import sys

import torch

from infini_dist.kernels.symm_device import DEFAULT_TUNING
from infini_dist.scheduler.backends.symm import plan_span
from infini_dist.scheduler.backends.symm_launch import tuning_of
from infini_dist.scheduler.choices import RunContext, algorithms_for
from multirank import SAFE_GPU_ENV, run_process, run_ranks
from symm_cases import (RSTD_TOLERANCE, TRAIN, build, digest, full_span, make_inputs,
                        max_error, meta_of, reference, rstd_error, worst_places)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def symm_algorithms() -> dict:
    """The registered symmetric-memory algorithms by name (those that launch a SymmKernel)."""
    return {a.name: a for a in algorithms_for("all_reduce", "cuda")
            if getattr(a, "kernel", None) is not None}


def algorithm_of(kernel):
    """The registered algorithm that launches `kernel` (a symm_call.SymmKernel)."""
    found = [a for a in symm_algorithms().values() if a.kernel is kernel]
    assert len(found) == 1, (kernel.kind, found)
    return found[0]


def _standard_cases(name: str) -> list:
    """Every pattern at a small shape, then the shapes that stress items and programs."""
    from symm_cases import PATTERNS
    cases = [(name, pattern, (3, 40), F32) for pattern in PATTERNS]
    return cases + [(name, "add_rms_norm", (5, 37), F32),   # row not a multiple of the vector
                    # more rows than programs, and an rsqrt per row of each program: TRAIN is
                    # add_rms_norm with two more outputs, so one case covers both (each such
                    # case was about a third of an interpreted 3-rank run)
                    (name, TRAIN, (130, 8), F32),
                    (name, TRAIN, (2, 64), BF16),
                    (name, "relu_scale", (3, 333), F32),    # numel not a multiple of anything
                    (name, "plain", (2, 4100), F32),        # several chunks
                    (name, "add_rms_norm", (2, 64), BF16),
                    (name, "swiglu", (3, 40), F16)]


def run_standard(monkeypatch, kernel, all_polled=False) -> None:
    """`kernel` on 3 interpreted ranks: every pattern and the awkward shapes through its engine
    algorithm, and two patterns through the kernel as a plain callable."""
    name = algorithm_of(kernel).name
    run_interpreted(monkeypatch, 3, _standard_cases(name) + _callable_cases(name, kernel),
                    all_polled=all_polled)


def run_cases(monkeypatch, kernel, world_size, patterns_and_shapes, all_polled=False) -> None:
    """`kernel`'s engine algorithm on fp32 (pattern, shape) cases at `world_size` ranks."""
    name = algorithm_of(kernel).name
    run_interpreted(monkeypatch, world_size, [(name, pattern, shape, F32)
                                              for pattern, shape in patterns_and_shapes],
                    all_polled=all_polled)


def _storage_key(algorithm, dtype):
    return algorithm.kind, algorithm.kernel.lamport_width(dtype)


# The plain callables' steps for two patterns of symm_cases: (prologue, epilogue, norm inputs).
CALLABLE_CASES = {
    "prologue_gelu": lambda v: dict(prologue=(("silu",), ("scale", 2.0)),
                                    epilogue=(("gelu_tanh",), ("mul", v["up"]), ("sigmoid",))),
    "prologue_norm": lambda v: dict(prologue=(("relu",),), epilogue=(("gelu",),),
                                    weight=v["w"], residual=v["res"], eps=1e-6),
    "add_rms_norm_quant_fp8_per_token": lambda v: dict(weight=v["w"], residual=v["res"],
                                                       eps=1e-5, quant=("quant_fp8_per_token",)),
    "silu_quant_fp8": lambda v: dict(epilogue=(("silu",),), quant=("quant_fp8", 0.02)),
}


def by_callable(function, pattern, values, buffer=None, tuning=DEFAULT_TUNING):
    """A CALLABLE_CASES pattern through `function` (a kernel's plain callable), outputs by name."""
    got = function(values["x"], buffer=buffer, tuning=tuning, **CALLABLE_CASES[pattern](values))
    return dict(zip(build(pattern).output_names, got if isinstance(got, tuple) else (got,)))


def _callable_cases(name: str, function) -> list:
    """The kernel file's plain callable (`function`) on the CALLABLE_CASES patterns."""
    return [(name, pattern, shape, dtype, function) for pattern in CALLABLE_CASES
            for shape, dtype in (((3, 40), F32), ((2, 64), BF16))]


def interpreted_rank(rank, world_size, storages, cases, all_polled):
    """One rank: every case twice (the second call lands in the other half), by the engine's
    algorithm, or by the plain callable where a case has one (a fifth item). Cases follow
    each other on one buffer per kind, so shape changes are covered. A Lamport buffer must be
    empty again once every rank has finished a call where `all_polled` (every place is polled,
    and readers empty all they read)."""
    import torch.distributed as dist

    import infini_dist
    from infini_dist.kernels.symm_buffers import EMPTY_PATTERN, from_peer_tensors, header_bytes
    ctx = RunContext(None, world_size, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())  # INFINI_DIST_SYMM_* from the env
    tuning = tuning_of(ctx.settings)
    algorithms = symm_algorithms()
    results = []
    for name, pattern, shape, dtype, *function in cases:
        algorithm = algorithms[name]
        graph = build(pattern)
        plan = plan_span(full_span(graph), meta_of(graph, shape, dtype), ctx)
        key = _storage_key(algorithm, dtype)
        buffer = from_peer_tensors(storages[key], rank)
        assert algorithm.data_bytes(plan, world_size) <= buffer.data_bytes
        for call in range(2):
            inputs = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
            if function:
                got = by_callable(function[0], pattern, inputs[rank], buffer, tuning)
            else:
                got = algorithm.launch(plan, inputs[rank], buffer, tuning)
            expected = reference(graph, inputs, rank)
            error = max_error(got, expected)
            # where it went wrong, for a failure that does not come back when run again
            detail = worst_places(got, expected) if error > tolerance(str(dtype)) else ""
            # The rsqrt is the one the norm used, to fp32 accuracy (the reference is looser).
            assert rstd_error(graph, got, inputs[rank]) <= RSTD_TOLERANCE, (name, pattern, shape)
            if all_polled:
                dist.barrier()
                word, bits = EMPTY_PATTERN[key[1]]
                data = storages[key][rank][header_bytes(world_size):].view(word)
                left = int((data != bits).sum())
                error = max(error, float(left))  # a place left full fails the tolerance
                detail += f"; {left} places left full" if left else ""
                dist.barrier()
            results.append(((name, pattern, bool(function), shape, str(dtype), call), error,
                            digest(got), detail))
    return results


def tolerance(dtype_name: str) -> float:
    return 1e-5 if dtype_name == str(F32) else 3e-2  # interpreter bf16 rounding truncates


def run_interpreted(monkeypatch, world_size, cases, data_bytes=1 << 18, all_polled=False):
    """`cases` (algorithm name, pattern, shape, dtype[, callable]) on `world_size` interpreted
    ranks: every output within tolerance of the fp32 reference and bitwise equal across ranks;
    `all_polled`: Lamport buffers are checked to be empty after every call."""
    from infini_dist.kernels.symm_buffers import fill_empty, header_bytes
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # spawned ranks inherit it before importing triton
    algorithms = symm_algorithms()
    storages = {}
    for name, _, _, dtype, *_ in cases:
        key = _storage_key(algorithms[name], dtype)
        if key not in storages:
            storages[key] = [torch.zeros(header_bytes(world_size) + data_bytes,
                                         dtype=torch.uint8).share_memory_()
                             for _ in range(world_size)]
            for storage in storages[key] if key[1] else ():
                fill_empty(storage, world_size, key[1])
    per_rank = run_ranks(interpreted_rank, world_size, storages, cases, all_polled, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    assert all(isinstance(r, list) for r in per_rank), repr(per_rank)[:2000]
    for results in zip(*per_rank):
        case = results[0][0]
        digests = [bits for _, _, bits, _ in results]
        for rank, (_, err, _, detail) in enumerate(results):
            assert err <= tolerance(case[4]), (
                f"{case} rank {rank}: error {err}; {detail}; ranks' digests "
                f"{[d[:8] for d in digests]}")
        # Side tensors are the same on every rank, so every output must match bitwise.
        assert len(set(digests)) == 1, f"{case}: ranks differ"


def late_rank(rank, world_size, storages, kernel_name):
    """Rank W-1 sleeps at the start of every phase 3 (`finish_items` of the kernel's module), so
    its last phase 3 of a small call runs after its peers have started a bigger one: the region
    it reads then must not be one the peers' next call writes before its first barrier."""
    import importlib
    import time

    import infini_dist
    from infini_dist.kernels.symm_buffers import from_peer_tensors
    algorithm = symm_algorithms()[kernel_name]
    module = importlib.import_module(algorithm.kernel.launch.__module__)
    if rank == world_size - 1:
        finish = module.finish_items

        def late(*args):
            time.sleep(0.5)
            return finish(*args)
        module.finish_items = late  # the interpreter resolves the kernel's globals per call
    ctx = RunContext(None, world_size, rank, torch.device("cuda"),
                     settings=infini_dist.config.snapshot())
    buffer = from_peer_tensors(storages, rank)
    results = []
    for pattern, shape, dtype in LATE_RANK_CASES:
        graph = build(pattern)
        plan = plan_span(full_span(graph), meta_of(graph, shape, dtype), ctx)
        for call in range(2):
            inputs = [make_inputs(graph, shape, dtype, r, call) for r in range(world_size)]
            got = algorithm.launch(plan, inputs[rank], buffer, tuning_of(ctx.settings))
            results.append((max_error(got, reference(graph, inputs, rank)), digest(got)))
    return results


# a small call, then a bigger one of another dtype (staging of the second far past the first's)
LATE_RANK_CASES = [("swiglu", (3, 40), torch.float16), ("plain", (48, 256), torch.float32)]


def run_with_a_late_rank(monkeypatch, kernel) -> None:
    """late_rank on 3 interpreted ranks: every output within tolerance of the fp32 reference
    and the same on every rank. For the barrier kernels (a Lamport buffer's empty pattern
    depends on the dtype, so one buffer cannot serve both cases)."""
    from infini_dist.kernels.symm_buffers import header_bytes
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    algorithm = algorithm_of(kernel)
    assert not algorithm.kernel.lamport
    storages = [torch.zeros(header_bytes(3) + (1 << 18), dtype=torch.uint8).share_memory_()
                for _ in range(3)]
    per_rank = run_ranks(late_rank, 3, storages, algorithm.name, timeout=600,
                         env={"TRITON_INTERPRET": "1"})
    for call, results in enumerate(zip(*per_rank)):
        assert all(error <= 3e-2 for error, _ in results), (call, results)
        assert len({bits for _, bits in results}) == 1, (call, "ranks differ")


def run_on_gpus(tmp_path, kernel) -> None:
    """tests/gpu_symm_worker.py for `kernel`'s algorithm alone: one torchrun per kernel, so that
    pytest-xdist runs the kernels' compiles side by side."""
    run_gpu_worker(tmp_path, "--quick", "--only", algorithm_of(kernel).name)


def run_gpu_worker(tmp_path, *arguments):
    """tests/gpu_symm_worker.py under torchrun on up to 4 GPUs; it must print ALL OK."""
    gpus = torch.cuda.device_count()
    env = dict(os.environ, **SAFE_GPU_ENV, INFINI_DIST_CACHE_DIR=str(tmp_path / "cache"))
    worker = os.path.join(os.path.dirname(__file__), "gpu_symm_worker.py")
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={min(gpus, 4)}", worker, *arguments], env=env,
                       timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ALL OK" in done.stdout
