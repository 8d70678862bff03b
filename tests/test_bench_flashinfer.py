"""The FlashInfer peer of `infini-dist bench` (launch/peers_flashinfer.py). Its kernels need GPUs
(and flashinfer, absent here: test_bench_native checks the skip line); the output check that
keeps a wrong peer from being timed runs here, on 2 gloo ranks, with real outputs."""

from __future__ import annotations

from multirank import run_ranks

# the FP8 ones return fp8 values (and fp32 scales) that may sit one e4m3 step off the reference
PATTERNS = ("add_rms_norm", "add_rms_norm_fp8", "add_rms_norm_fp8_tensor", "add_rms_norm_fp8_token",
            "swiglu", "relu_scale")


def _verdicts(rank, world_size):
    import torch
    import torch.distributed as dist

    from infini_dist.launch import bench_patterns
    from infini_dist.launch.peers_flashinfer import output_error

    found = {}
    for pattern in PATTERNS:
        inputs = bench_patterns.make_inputs(pattern, 8, 64, torch.bfloat16,
                                            torch.device("cpu"), rank)

        def epilogue(y, sides, pattern=pattern):
            return bench_patterns.eager_epilogue(pattern, y, sides)
        summed = inputs["x"].clone()
        dist.all_reduce(summed)  # in bf16: what a 16-bit peer returns is as far off as this
        right = epilogue(summed, inputs)
        alone = epilogue(inputs["x"], inputs)  # this rank's share only: a broken all-reduce
        one_rank_wrong = alone if rank == 1 else right

        def dequantize(outs, pattern=pattern):
            return bench_patterns.dequantized(pattern, outs)
        found[pattern] = [output_error(got, inputs, epilogue, None, dequantize)
                          for got in (right, alone, one_rank_wrong)]
    nan = bench_patterns.make_inputs("relu_scale", 4, 64, torch.float32, torch.device("cpu"),
                                     rank)
    got = torch.full_like(nan["x"], float("nan"))
    found["nan"] = output_error(
        got, nan, lambda y, s: bench_patterns.eager_epilogue("relu_scale", y, s), None)
    return found


def test_output_check_passes_a_right_peer_and_fails_a_wrong_one_on_every_rank():
    per_rank = run_ranks(_verdicts, 2)
    assert per_rank[0] == per_rank[1]  # one verdict: no rank times what another skips
    for pattern in PATTERNS:
        right, alone, one_rank_wrong = per_rank[0][pattern]
        assert right is None, (pattern, right)
        assert alone and "fp32 reference" in alone, pattern
        assert one_rank_wrong and "fp32 reference" in one_rank_wrong, pattern
    assert per_rank[0]["nan"] and "inf" in per_rank[0]["nan"]


def test_fused_variants_per_pattern():
    """Which patterns one FlashInfer fusion kernel computes whole (and with which outputs, in the
    eager epilogue's order); the others time its plain all-reduce (no residual or weight read)."""
    import types

    import torch

    from infini_dist.launch import bench_patterns
    from infini_dist.launch.peers_flashinfer import FlashInferPeers

    codes = types.SimpleNamespace(kAllReduce=0, kARResidualRMSNorm=1,
                                  kARResidualRMSNormFP8Quant=2,
                                  kARResidualRMSNormDynamicFP8Quant=10)
    peer = FlashInferPeers.__new__(FlashInferPeers)  # no workspace: _fused only reads the codes
    peer.comm = types.SimpleNamespace(AllReduceFusionPattern=codes)
    found = {}
    for pattern in PATTERNS:
        inputs = bench_patterns.make_inputs(pattern, 4, 32, torch.bfloat16, torch.device("cpu"),
                                            0)
        fused = peer._fused(pattern, inputs["x"], inputs, 1e-6, bench_patterns.FP8_SCALE)
        found[pattern] = None if fused is None else (fused[0], fused[2])
        if fused is not None and "scale_factor" in fused[1]:  # FlashInfer multiplies by 1/it
            assert float(fused[1]["scale_factor"]) == float(torch.tensor(bench_patterns.FP8_SCALE))
    assert found == {"add_rms_norm": (1, ("norm_out", "residual_out")),
                     "add_rms_norm_fp8": (2, ("quant_out", "residual_out")),
                     "add_rms_norm_fp8_tensor": (2, ("quant_out", "residual_out")),
                     "add_rms_norm_fp8_token": (10, ("quant_out", "scale_out", "residual_out")),
                     "swiglu": None, "relu_scale": None}


def test_each_kernel_is_timed_without_and_with_programmatic_dependent_launch():
    # Our streamed kernel launches with PDL where the GPU has it, so FlashInfer's kernels get
    # their own PDL rows (`_pdl`) beside the plain ones; the one-shot only while its Lamport
    # buffer holds the tensor, the two-shot only past one token a rank.
    import torch

    from infini_dist.launch.peers_flashinfer import FlashInferPeers

    peer = FlashInferPeers.__new__(FlashInferPeers)
    peer.hidden, peer.world, peer.dtype = 64, 2, torch.bfloat16
    peer.meta = {"lamport_comm_size": 8 * 64 * 2 * 2}
    assert peer._variants(8) == [("one_shot", True, False), ("one_shot_pdl", True, True),
                                 ("two_shot", False, False), ("two_shot_pdl", False, True)]
    assert peer._variants(16) == [("two_shot", False, False), ("two_shot_pdl", False, True)]
    assert peer._variants(2) == [("one_shot", True, False), ("one_shot_pdl", True, True)]
