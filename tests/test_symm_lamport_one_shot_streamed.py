"""kernels/lamport_one_shot_streamed.py, interpreted on CPU ranks by its engine algorithm and as a
plain callable (every polled place emptied after each call), and on GPUs (tests/symm_runs.py).
Its own shapes: programs with several groups, so a group's pushes run ahead of its reduction,
at 2 and 4 ranks."""

import pytest

from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from symm_runs import run_cases, run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, lamport_one_shot_streamed_all_reduce, all_polled=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_interpreted_several_groups(monkeypatch, world_size):
    # 600 rows over 128 programs: 4 or 5 a program, in groups of 2 (the last one partial).
    run_cases(monkeypatch, lamport_one_shot_streamed_all_reduce, world_size,
              [("add_rms_norm", (600, 8)), ("relu_scale", (600, 8))], all_polled=True)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, lamport_one_shot_streamed_all_reduce)
