"""kernels/lamport_one_shot_streamed.py, interpreted on CPU ranks by its engine algorithm and as a
plain callable (every polled place emptied after each call), and on GPUs (tests/symm_runs.py).
Its own shapes: programs with several groups, so a group's pushes run ahead of its reduction,
at 2 and 4 ranks, one item a step and two."""

import pytest

from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from symm_runs import run_cases, run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, lamport_one_shot_streamed_all_reduce, all_polled=True)


@pytest.mark.parametrize("world_size, group, preload", [(2, 0, True), (4, 2, True), (2, 2, False)])
def test_interpreted_several_groups(monkeypatch, world_size, group, preload):
    # 300 rows over 128 programs: 2 or 3 a program, one a step (the layout's) or two (forced:
    # the [W, group, row] tile, the last group partial); the epilogue's operands read before
    # the poll (the default) or after it
    if group:
        monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", str(group))
    monkeypatch.setenv("INFINI_DIST_SYMM_PRELOAD", str(int(preload)))
    run_cases(monkeypatch, lamport_one_shot_streamed_all_reduce, world_size,
              [("add_rms_norm", (300, 8))], all_polled=True)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, lamport_one_shot_streamed_all_reduce)


def test_two_rows_a_step_with_many_rows_a_program():
    # Two rows a step once a program has 64 (128 programs: 8192 rows), with a quantizer or
    # without; one otherwise, and never past 4 ranks or without a norm.
    import torch

    from infini_dist.kernels.symm_buffers import from_peer_tensors, header_bytes
    per_token, static = ("quant_fp8_per_token",), ("quant_fp8", 0.05)
    for world_size in (2, 4, 8):
        buffer = from_peer_tensors([torch.zeros(header_bytes(world_size) + (1 << 24),
                                                dtype=torch.uint8) for _ in range(world_size)], 0)
        for rows, quant, group in [(4096, per_token, 1), (8192, per_token, 2), (4096, None, 1),
                                   (4096, static, 1), (8191, per_token, 1), (8192, None, 2),
                                   (8192, static, 2), (8191, None, 1)]:
            x = torch.randn(rows, 8)
            *_, kwargs, _ = lamport_one_shot_streamed_all_reduce.bind(
                x, weight=torch.rand(8), residual=torch.randn(rows, 8), quant=quant,
                buffer=buffer)
            assert kwargs["GROUP"] == (group if world_size <= 4 else 1), (rows, quant)
        *_, kwargs, _ = lamport_one_shot_streamed_all_reduce.bind(torch.randn(8192, 8),
                                                                  buffer=buffer)
        assert kwargs["GROUP"] == 1  # no norm: chunks, not rows

