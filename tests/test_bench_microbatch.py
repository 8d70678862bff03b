"""launch/bench_microbatch.py and launch/row_split.py on CPU: the pipelined order keeps every
micro-batch's own order and puts the other micro-batch's work between a stage's copy and its
reduction; the GEMM-into-buffer forms of the TP decoder's attention and MLP compute what
tp_decoder's do; the row split's parts cover every row once, and its forward without
communication (GEMMs in row parts, the reduction kernel interpreted) gives the floor's;
`rs_ag_spin`'s half barrier: the flag wait kernel (interpreted) and the driver's flag write."""

from __future__ import annotations

import pytest
import torch

from infini_dist.launch import bench_microbatch, row_split
from infini_dist.scheduler import split_site
from infini_dist.launch.tp_decoder import Layer, ModelConfig
from multirank import run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("stages,microbatches", [(1, 2), (8, 2), (5, 3)])
def test_schedule(stages, microbatches):
    order = bench_microbatch.schedule(stages, microbatches)
    every = [(step, mb, k) for mb in range(microbatches) for k in range(stages)
             for step in ("compute", "site")]
    assert sorted(order) == sorted(every)  # each step once
    at = {step: i for i, step in enumerate(order)}
    for mb in range(microbatches):
        for k in range(stages):
            compute, site = at["compute", mb, k], at["site", mb, k]
            assert compute < site
            if k + 1 < stages:  # the next stage reads this one's reduction
                assert site < at["compute", mb, k + 1]
            # what hides this stage's copy: another micro-batch's compute before the reduction
            # (not for the last micro-batch's last stage, the pipeline's tail)
            between = order[compute + 1:site]
            hidden = any(step == "compute" and other != mb for step, other, _ in between)
            assert hidden != (mb == microbatches - 1 and k == stages - 1)


def test_the_gemms_into_a_buffer_compute_the_layers_outputs():
    cfg = ModelConfig(layers=1, hidden=64, mlp=96, heads=4, kv_heads=2, context=8)
    layer = Layer(cfg, 1, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2),
                  "cpu", torch.float64)
    h = torch.randn(2, 5, cfg.hidden, dtype=torch.float64)
    attention, mlp = (torch.empty(10, cfg.hidden, dtype=torch.float64) for _ in range(2))
    bench_microbatch.attention_into(layer, h, attention)
    bench_microbatch.mlp_into(layer, h, mlp)
    torch.testing.assert_close(attention.view(h.shape), layer.attention(h, None, None))
    torch.testing.assert_close(mlp.view(h.shape), layer.mlp(h))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_row_parts_cover_every_row_once_the_peers_first_in_turn(world):
    rows = 6 * world
    for rank in range(world):
        own, others = row_parts = split_site.row_parts(rows, world, rank)
        covered = sorted(i for part in [own, *others] for i in range(rows)[part])
        assert covered == list(range(rows))
        assert own == slice(rank * 6, rank * 6 + 6)
        # rank r pushes to r + 1 first: at each step every rank sends to a different peer
        assert [part.start // 6 for part in others] == [(rank + i) % world
                                                        for i in range(1, world)], row_parts


def test_row_parts_refuse_rows_that_do_not_cut():
    with pytest.raises(ValueError, match="do not cut into 3 parts"):
        split_site.row_parts(8, 3, 0)
    with pytest.raises(ValueError, match="none of"):
        row_split.RowSplit("rs_push", None, None, [], None, "cpu")


def _row_split_floor_rank(rank, world_size):
    import torch.distributed as dist
    from infini_dist.launch.tp_decoder import Decoder
    cfg = ModelConfig(layers=2, hidden=64, mlp=96, heads=4, kv_heads=2, context=6)
    group = dist.group.WORLD
    model = Decoder(cfg, group, "cpu", torch.float32)
    x = torch.randn(2, 6, cfg.hidden, generator=torch.Generator().manual_seed(3))
    floor = bench_microbatch.Variant("floor", model, x, group, "cpu")()
    split = row_split.RowSplit("floor_rs_ag", model, x, bench_microbatch.stage_norms(model),
                               group, "cpu")()
    return floor.reshape(split.shape), split


@pytest.mark.timeout(240)
def test_the_row_split_without_communication_gives_the_floor():
    for floor, split in run_ranks(_row_split_floor_rank, 2, timeout=220,
                                  env={"TRITON_INTERPRET": "1"}):
        assert floor.abs().max() > 0.5  # a real forward, not zeros
        torch.testing.assert_close(split, floor, rtol=1e-5, atol=1e-5)


def _flag_wait_rank(rank, world_size):
    from infini_dist.kernels.chunk_reduce import flag_wait_launch
    flags = torch.tensor([1, 7, 1, 1], dtype=torch.int32)  # rank 1's own entry is never read
    row_split.launch(flag_wait_launch(flags, 1, 4))
    return flags


@pytest.mark.timeout(120)
def test_the_flag_wait_clears_the_peers_flags_alone():
    # a wait that read its own entry, or none, would leave a 1; one that cleared it, a 0
    (flags,) = run_ranks(_flag_wait_rank, 1, timeout=100, env={"TRITON_INTERPRET": "1"})
    assert flags.tolist() == [0, 7, 0, 0]


def test_the_driver_sets_a_flag_after_the_streams_work():
    from infini_dist.kernels.cuda_driver import Driver, DriverError

    class Library:
        calls = []

        def cuEventRecord(self, *args):
            return 0
        cuStreamWaitEvent = cuMemcpyDtoDAsync_v2 = cuEventRecord

        def cuStreamWriteValue32_v2(self, *args):
            self.calls.append(args)
            return 0 if args[1] else 1  # CUDA_ERROR_INVALID_VALUE for a null address

    library = Library()
    Driver(library).write_value(5, 0x1000, 1)
    # default flags: the write waits for the stream's earlier work and its memory
    assert library.calls == [(5, 0x1000, 1, 0)]
    with pytest.raises(DriverError, match="cuStreamWriteValue32 failed with CUDA driver error 1"):
        Driver(library).write_value(5, 0, 1)
