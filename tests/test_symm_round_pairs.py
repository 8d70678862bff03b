"""symm_chain.round_pairs_to: the quantizer's input rounded to bf16 two elements a conversion,
with round_to's bits. On the CPU: a quantizing kernel compiled for sm_90 converts its bf16
rounding in pairs (the element-wise cvt.rn.bf16.f32 was the static FP8 output's cost on H100s).
On a GPU: its bits against round_to's and torch's cast, for every class of value, with one and
with several elements a thread."""

from __future__ import annotations

import pytest
import torch

from launch_stub import compile_pool


def _quantizing_ptx(quant):
    """In the compile worker: the PTX of the streamed one-shot with AR + add + RMSNorm + `quant`
    on a 4096-wide bf16 row, as the GPU launches it (PDL on)."""
    from infini_dist.kernels.lamport_one_shot_streamed import \
        lamport_one_shot_streamed_all_reduce as kernel
    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    buffer = from_peer_tensors([torch.zeros(header_bytes(2) + (1 << 16), dtype=torch.uint8)
                                for _ in range(2)], 0)
    jit, grid, args, kwargs, _ = kernel.bind(
        x, buffer=buffer, norm="rms_norm", weight=torch.ones(4096, dtype=torch.bfloat16),
        residual=torch.zeros_like(x), quant=quant)
    return jit.warmup(*args, grid=grid, **dict(kwargs, ON_GPU=True, PDL=True)).asm["ptx"]


def test_the_quantizer_input_is_rounded_in_pairs(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    with compile_pool(str(tmp_path / "home")) as pool:
        static = pool.submit(_quantizing_ptx, ("quant_fp8", 0.05)).result(timeout=600)
        token = pool.submit(_quantizing_ptx, ("quant_fp8_per_token",)).result(timeout=600)
    # 8 elements a thread: 4 paired conversions for the residual's store, 4 for the rounding
    assert static.count("cvt.rn.bf16.f32") == 0
    assert static.count("cvt.rn.bf16x2.f32") == 8
    # per-token rounds one more value alone: the row's peak, one a row
    assert token.count("cvt.rn.bf16.f32") == 1


def _round_kernel():
    import triton
    import triton.language as tl

    from infini_dist.kernels.symm_chain import round_pairs_to, round_to

    @triton.jit
    def kernel(x_ptr, pairs_ptr, single_ptr, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        tl.store(pairs_ptr + offsets, round_pairs_to(x, tl.bfloat16), mask=mask)
        tl.store(single_ptr + offsets, round_to(x, tl.bfloat16), mask=mask)
    return kernel


def _every_class_of_value(device):
    bits = torch.tensor([
        0x00000000, 0x80000000,              # +-0
        0x7F800000, 0xFF800000,              # +-inf
        0x7FC00000, 0x7F800001, 0xFFFFFFFF,  # NaNs, one whose payload is in the low half only
        0x00000001, 0x807FFFFF, 0x00008000,  # fp32 denormals, one a bf16 tie
        0x7F7FFFFF, 0x7F7F8000,              # the largest finite: rounds to inf; a tie to inf
        0x3F808000, 0x3F818000,              # ties to even, down and up
        0x3F808001, 0x3F807FFF,              # just past and just before a tie
    ], dtype=torch.int64).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4001, generator=g) * torch.logspace(-40, 38, 4001)
    anything = torch.randint(-2 ** 31, 2 ** 31 - 1, (4000,), generator=g, dtype=torch.int32)
    return torch.cat([bits, spread, anything.view(torch.float32)]).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("block,warps", [(128, 4), (1024, 4), (4096, 16)])
def test_round_pairs_has_round_tos_bits_on_a_gpu(block, warps):
    # 128 / 4 warps: one element a thread (a pair padded); the others 8 a thread
    import triton
    x = _every_class_of_value("cuda")
    pairs, single = torch.empty_like(x), torch.empty_like(x)
    _round_kernel()[(triton.cdiv(x.numel(), block),)](x, pairs, single, x.numel(), BLOCK=block,
                                                      num_warps=warps)
    assert torch.equal(pairs.view(torch.int32), single.view(torch.int32))
    cast = x.to(torch.bfloat16).float()
    number = ~x.isnan()
    assert torch.equal(pairs[number].view(torch.int32), cast[number].view(torch.int32))
    assert pairs[~number].isnan().all()
