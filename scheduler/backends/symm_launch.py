"""How the symmetric-memory algorithms launch: the kernel knobs from the engine's settings, the
compile-time warm-up on private scratch (no peer takes part), and `PreparedLaunch`, the per-call
path of a committed choice (scheduler/backends/symm.py, symm_scatter.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infini_dist.kernels import symm_buffers
from infini_dist.kernels.nt_runtime import FastLaunch
from infini_dist.kernels.symm_device import DEFAULT_TUNING, SymmTuning

if TYPE_CHECKING:
    from infini_dist.scheduler.backends.symm import SpanPlan


def tuning_of(settings) -> SymmTuning:
    """The kernels' launch knobs from the engine's settings (None: the kernels' defaults)."""
    if settings is None:
        return DEFAULT_TUNING
    return SymmTuning(settings.symm_timeout_s, settings.symm_group_items,
                      settings.symm_round_items, settings.symm_preload,
                      pdl=settings.symm_pdl)


class PreparedLaunch:
    """`algorithm.launch(plan, env, buffer)` for one plan and buffer, with the per-call host
    work cut to: look up the inputs, check them, allocate the outputs, launch
    (`nt_runtime.FastLaunch`). Inputs of other shapes or layouts than the first call's take
    `algorithm.launch`, which copies them contiguous. `fast=False` (the fast_launch setting):
    every call takes `algorithm.launch`, exactly the normal path, for A/B timing."""

    def __init__(self, algorithm, plan: SpanPlan, buffer, env: dict,
                 tuning: SymmTuning = DEFAULT_TUNING, fast: bool = True):
        self.algorithm, self.plan, self.buffer, self.tuning = algorithm, plan, buffer, tuning
        self.names = plan.tensor_inputs
        self.shapes = tuple(env[name].shape for name in self.names)
        # Stand-ins, each its own object, so FastLaunch can tell which argument is which
        # per-call tensor (x also fills the unused pointer slots).
        inputs = {name: env[name].view(env[name].shape) for name in self.names}
        written = {k: object() for k in plan.writes}
        kernel, grid, args, kwargs = algorithm.launch_arguments(
            plan, inputs[plan.source], inputs, buffer, written, tuning)
        per_call = [inputs[name] for name in self.names] + list(written.values())
        self.launch = FastLaunch(kernel, grid, args, kwargs, per_call, enabled=fast)
        self.enabled = fast

    def bound(self, tensors: list) -> bool:
        """Whether `tensors` (by self.names) take the bound launch: the first call's dtype,
        shapes and contiguity, with the fast path enabled."""
        return (self.enabled and tensors[0].dtype is self.plan.dtype
                and all(t.shape == s and t.is_contiguous()
                        for t, s in zip(tensors, self.shapes)))

    def __call__(self, env: dict) -> dict:
        tensors = [env[name] for name in self.names]
        if not self.bound(tensors):
            return self.algorithm.launch(self.plan, env, self.buffer, self.tuning)
        x = tensors[0]
        written = self.plan.allocate(x.device, x)
        self.launch(*tensors, *written.values())
        return self.plan.results(written)


def warm_up(algorithm, plan, names, meta, ctx) -> tuple[int, SymmTuning, bool]:
    """Compile `algorithm`'s kernel for `plan` by one launch on private scratch whose barriers
    are already met: no peer takes part, so every rank may compile at its own pace. Returns the
    buffer bytes, the kernel knobs and whether launches take the fast path."""
    if plan is None:
        raise ValueError(f"{algorithm.name}: span not supported")
    data_bytes = algorithm.data_bytes(plan, ctx.world_size)
    tuning = tuning_of(ctx.settings)
    with torch.cuda.device(ctx.device):
        scratch = {n: torch.randn(meta[n].shape, device=ctx.device).to(meta[n].dtype)
                   for n in names}
        buffer = symm_buffers.local_scratch(ctx.world_size, ctx.rank, data_bytes, ctx.device)
        algorithm.launch(plan, scratch, buffer, tuning)
        torch.cuda.synchronize(ctx.device)
    return data_bytes, tuning, ctx.settings.fast_launch if ctx.settings is not None else True


def compile_on_buffer(algorithm, plan, meta, ctx, kind: str, bind) -> "PreparedAtFirstCall":
    """`algorithm`'s runner for `plan`: its warm-up now, and at the first call (collective) the
    group's buffer of `kind` and `bind(buffer, env, tuning, fast)`, what every call runs."""
    data_bytes, tuning, fast = warm_up(algorithm, plan, plan and plan.tensor_inputs, meta, ctx)
    return PreparedAtFirstCall(lambda env: bind(
        symm_buffers.get_buffer(ctx.group, ctx.device, kind, data_bytes), env, tuning, fast))


class SideStreams:
    """One side stream per device, made at first use: where an algorithm's copy-engine copies
    run beside the caller's stream (symm_chunked, symm_overlap)."""

    def __init__(self):
        self._streams = {}

    def __call__(self, device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


class PreparedAtFirstCall:
    """A runner that calls `prepare(env)` at its first call, then what it returned (kept as
    `prepared`) at every call. The first call is collective (the buffer's allocation and
    rendezvous), which is why it is not made in `compile`: the engine makes it eagerly and in
    lockstep on every rank."""

    def __init__(self, prepare):
        self._prepare = prepare
        self.prepared = None

    def __call__(self, env):
        prepared = self.prepared
        if prepared is None:
            prepared = self.prepared = self._prepare(env)
        return prepared(env)
