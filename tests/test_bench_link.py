"""launch/bench_link.py, the link probe, on CPU: its copy kernel copies (interpreted, at sizes that
leave a ragged last block and more blocks than programs), its data is rank-specific and never
zeros, and its table carries failures and rates as measured."""

from __future__ import annotations

import pytest
import torch

from infini_dist.launch import bench_link

pytestmark = pytest.mark.timeout(120)


def _copy(numel, programs):
    src = bench_link.source(3, numel, "cpu")
    dst = torch.zeros_like(src)
    bench_link._copy_kernel[(programs,)](src, dst, numel, BLOCK=64)
    return src, dst


@pytest.mark.parametrize("numel,programs", [(1000, 3), (64, 4), (4096, 1)])
def test_copy_kernel_copies_every_element(pool, numel, programs):
    src, dst = pool.submit(_copy, numel, programs).result()
    assert torch.equal(src, dst)


def test_source_is_per_rank_and_never_zeros():
    a, b = bench_link.source(0, 4096, "cpu"), bench_link.source(1, 4096, "cpu")
    assert torch.equal(a, bench_link.source(0, 4096, "cpu"))
    assert not torch.equal(a, b)
    assert (a != 0).float().mean() > 0.99 and a.dtype == torch.bfloat16


def test_rate_and_table():
    # 64 MiB a direction in 160 µs: 419 GB/s
    assert bench_link.gbps(64 * 2 ** 20, 160e-6) == pytest.approx(419.43, rel=1e-3)
    rows = [dict(mib=64, name="ce_push", us=160.0, gbps=419.43, check="received"),
            dict(mib=64, name="nccl_sendrecv", error="RuntimeError: capture")]
    text = bench_link.table(rows)
    assert "| 64 | ce_push | 160.0 | 419 | received |" in text
    assert "| 64 | nccl_sendrecv | | | RuntimeError: capture |" in text
