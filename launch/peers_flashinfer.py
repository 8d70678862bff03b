"""FlashInfer's TensorRT-LLM all-reduce kernels as peers of the latency sweep (launch/bench.py).

Optional: `pip install infini_dist[flashinfer]` (the device carries a trimmed wheel, made by
.ci/trim_flashinfer_wheel). Rows, per pattern and token count:
  fi_fused_one_shot   add_rms_norm: trtllm_allreduce_fusion, pattern kARResidualRMSNorm, the
                      Lamport one-shot kernel (all-reduce + residual add + RMSNorm in one kernel)
  fi_fused_two_shot   the same, its two-shot kernel (needs tokens > world size)
  fi_ar_one_shot      other patterns: the same kernels with pattern kAllReduce, then the
  fi_ar_two_shot      epilogue in eager torch (as the symm_* peers)
Every kernel runs with fp32 accumulation, each without programmatic dependent launch and with it
(the `_pdl` rows), since our kernels take it where the GPU has it. One IPC workspace per group,
sized for the sweep's largest case, made once and freed by close(); its first use JIT-builds the
kernels with nvcc (minutes, cached after).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from infini_dist.launch.bench_patterns import STATIC_FP8

NOT_INSTALLED = ("flashinfer: not installed (pip install infini_dist[flashinfer]); "
                 "its rows are skipped")
WORLD_SIZES = (2, 4, 8, 16)  # what trtllm_allreduce_fusion dispatches on
# Elementwise |got - ref| <= ATOL + RTOL * |ref| against the float32 reference: a 16-bit output
# is a few roundings away from it; a missing or doubled rank's share is far outside.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2 ** -6, 2 ** -6),
             torch.float16: (2 ** -6, 2 ** -6)}
# A dequantized fp8 output may sit one e4m3 step further off (2^-3 relative): rounding the
# reference's value and ours can fall on either side of a step.
FP8_STEP = 2 ** -3


def open_peers(group, max_tokens: int, hidden: int, dtype, device):
    """The FlashInfer peers for this group, or None (the reason printed once, on rank 0)."""
    reason, comm = None, None
    try:
        import flashinfer.comm as comm
    except Exception as error:  # noqa: BLE001 - installed but broken (a missing dependency...)
        absent = isinstance(error, ModuleNotFoundError) and error.name == "flashinfer"
        reason = NOT_INSTALLED if absent else (
            f"flashinfer: import failed ({type(error).__name__}: {error}); its rows are skipped")
    if comm is not None and device.type != "cuda":
        reason = "flashinfer: needs CUDA ranks; its rows are skipped"
    elif comm is not None and dist.get_world_size(group) not in WORLD_SIZES:
        reason = (f"flashinfer: its kernels take {WORLD_SIZES} ranks, not "
                  f"{dist.get_world_size(group)}; its rows are skipped")
    peers = None
    if reason is None:
        try:  # the first use JIT-builds the kernels: a failure there is the same on every rank
            peers = FlashInferPeers(comm, group, max_tokens, hidden, dtype)
        except Exception as error:  # noqa: BLE001 - the sweep goes on without this peer
            reason = f"flashinfer: setup failed ({type(error).__name__}: {error}"[:400] + (
                "); its rows are skipped")
    if reason is not None and dist.get_rank() == 0:
        print(reason, flush=True)
    return peers


class FlashInferPeers:
    def __init__(self, comm, group, max_tokens, hidden, dtype):
        self.comm, self.group, self.hidden, self.dtype = comm, group, hidden, dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # The legacy API (marked deprecated in 0.7) allocates through torch symmetric memory,
        # which runs on the device; the unified one exchanges cuMem handles over fds.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.handles, self.workspace, self.meta = (
                comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                    self.rank, self.world, max_tokens, hidden,
                    use_fp32_lamport=dtype == torch.float32, group=group,
                    create_metadata=True))

    def close(self):
        if self.handles is not None:
            torch.cuda.synchronize()
            dist.barrier(group=self.group)  # no rank frees while a peer still reads its buffers
            self.comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.handles,
                                                                         self.group)
            self.handles = self.workspace = None

    def _variants(self, tokens: int) -> list[tuple[str, bool, bool]]:
        """(name suffix, one-shot, programmatic dependent launch): each kernel without PDL and
        with it (`_pdl`), as ours run where the GPU has it."""
        # The one-shot kernel stages every rank's input in the Lamport buffer; past its size the
        # library would switch to two-shot under the one-shot name, so the row is left out.
        lamport = tokens * self.hidden * self.world * self.dtype.itemsize
        out = [("one_shot", True)] if lamport <= self.meta["lamport_comm_size"] else []
        if tokens > self.world:  # the two-shot kernel splits the tokens over the ranks
            out.append(("two_shot", False))
        return [(suffix + tail, oneshot, pdl) for suffix, oneshot in out
                for tail, pdl in (("", False), ("_pdl", True))]

    def _call(self, x, oneshot, pdl, pattern_code, **outputs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.comm.trtllm_allreduce_fusion(
                allreduce_in=x, world_size=self.world, world_rank=self.rank,
                token_num=x.shape[0], hidden_dim=self.hidden, workspace_ptrs=self.workspace,
                launch_with_pdl=pdl, trigger_completion_at_end=True, fp32_acc=True,
                pattern_code=pattern_code, use_oneshot=oneshot,
                allreduce_out=outputs.get("allreduce_out"),
                residual_in=outputs.get("residual_in"),
                residual_out=outputs.get("residual_out"), norm_out=outputs.get("norm_out"),
                quant_out=outputs.get("quant_out"), scale_out=outputs.get("scale_out"),
                rms_gamma=outputs.get("rms_gamma"), rms_eps=outputs.get("rms_eps"),
                scale_factor=outputs.get("scale_factor"), layout_code=None,
                metadata=self.meta)

    def _fused(self, pattern, x, inputs, eps, fp8_scale):
        """(pattern code, outputs, the outputs in the epilogue's order) for a pattern one
        fusion kernel computes whole, else None."""
        codes = self.comm.AllReduceFusionPattern
        if not pattern.startswith("add_rms_norm"):  # no residual or weight: the AR rows only
            return None
        outs = {"residual_out": torch.empty_like(x), "residual_in": inputs["residual"],
                "rms_gamma": inputs["weight"], "rms_eps": eps}
        if pattern == "add_rms_norm":
            outs["norm_out"] = torch.empty_like(x)
            return codes.kARResidualRMSNorm, outs, ("norm_out", "residual_out")
        fp8 = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        if pattern in STATIC_FP8:  # it multiplies by 1 / scale_factor
            outs.update(quant_out=fp8, scale_factor=torch.tensor(
                [fp8_scale], dtype=torch.float32, device=x.device))
            return codes.kARResidualRMSNormFP8Quant, outs, ("quant_out", "residual_out")
        if pattern == "add_rms_norm_fp8_token" and hasattr(
                codes, "kARResidualRMSNormDynamicFP8Quant"):
            outs.update(quant_out=fp8, scale_out=torch.empty(
                x.shape[0], 1, dtype=torch.float32, device=x.device))
            return (codes.kARResidualRMSNormDynamicFP8Quant, outs,
                    ("quant_out", "scale_out", "residual_out"))
        return None

    def peers(self, pattern, inputs, epilogue, eps, fp8_scale=None, dequantize=None):
        """name -> (callable, reset), as bench.peers. `epilogue(y, inputs)` is the user's eager
        epilogue (for add_rms_norm it returns (normed, y + residual), which the fused kernel
        must match). A variant whose output is off the float32 reference on any rank raises
        instead of running, so its row shows the error."""
        x = inputs["x"]
        if x.shape[1] != self.hidden or x.dtype != self.dtype:
            raise ValueError(f"workspace is for hidden {self.hidden} {self.dtype}, "
                             f"got {tuple(x.shape)} {x.dtype}")
        codes = self.comm.AllReduceFusionPattern
        impls = {}
        for suffix, oneshot, pdl in self._variants(x.shape[0]):
            fused = self._fused(pattern, x, inputs, eps, fp8_scale)
            if fused is not None:
                def run(oneshot=oneshot, pdl=pdl, fused=fused):
                    code, outs, order = fused
                    self._call(x, oneshot, pdl, code, **outs)
                    return tuple(outs[name] for name in order)
                name = f"fi_fused_{suffix}"
            else:
                y = torch.empty_like(x)

                def run(oneshot=oneshot, pdl=pdl, y=y):
                    self._call(x, oneshot, pdl, codes.kAllReduce, allreduce_out=y)
                    return epilogue(y, inputs)
                name = f"fi_ar_{suffix}"
            try:
                # slack 2: the kernels round the all-reduce to the dtype before the residual
                # add, as the unfused path does
                error = output_error(run(), inputs, epilogue, self.group, dequantize, slack=2.0)
            except Exception as failure:  # noqa: BLE001 - a shape the kernels refuse, say
                error = f"{type(failure).__name__}: {failure}"[:300]
            if error is None:
                impls[name] = (run, lambda: None)
            else:
                if dist.get_rank() == 0:
                    print(f"  {name} wrong: {error}; not timed", flush=True)
                impls[name] = (_raiser(error), lambda: None)
        return impls


def output_error(got, inputs, epilogue, group, dequantize=None, slack=1.0) -> str | None:
    """None when `got` (this rank's output, a tensor or a tuple) matches the float32 reference
    `epilogue(sum of every rank's x, inputs)` on every rank of `group`, else what is off: one
    verdict on all ranks, so none times a peer that another skips. An FP8 pattern passes
    `dequantize(outputs) -> outputs`, its first in the input's units, which is compared; a
    path that rounds after every op (an eager epilogue) passes `slack` > 1, its tolerance's
    multiple."""
    wide = {k: v.float() for k, v in inputs.items()}
    y = wide["x"].clone()
    dist.all_reduce(y, group=group)
    want = epilogue(y, wide)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    if dequantize is not None:
        got, want = dequantize(got), dequantize(want)
    # fp32 outputs (FP8 scales) come from 16-bit ones
    atol, rtol = (slack * bound for bound in TOLERANCE[inputs["x"].dtype])

    def excess(i, g, w):  # in units of atol: at most 1 passes
        step = FP8_STEP if dequantize is not None and i == 0 else 0.0
        far = (g.float() - w.float()).abs() - (rtol + step) * w.float().abs()
        return float(torch.nan_to_num(far / atol, nan=float("inf")).max())
    worst = max(excess(i, g, w) for i, (g, w) in enumerate(zip(got, want)))
    worst = torch.tensor([worst], dtype=torch.float64, device=inputs["x"].device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    worst = float(worst.item())
    return None if worst <= 1.0 else (
        f"|out - fp32 reference| exceeds its tolerance (atol + rtol*|ref|) by up to "
        f"{worst:.3g} atol")


def _raiser(message):
    def fail():
        raise RuntimeError(f"wrong output: {message}")
    return fail
