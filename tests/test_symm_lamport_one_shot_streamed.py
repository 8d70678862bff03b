"""kernels/lamport_one_shot_streamed.py, interpreted on CPU ranks by its engine algorithm and as a
plain callable (every polled place emptied after each call), and on GPUs (tests/symm_runs.py).
Its own shapes: programs with several groups, so a group's pushes run ahead of its reduction,
at 2 and 4 ranks, one item a step and two."""

import pytest

from infini_dist.kernels.lamport_one_shot_streamed import lamport_one_shot_streamed_all_reduce
from symm_runs import run_cases, run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, lamport_one_shot_streamed_all_reduce, all_polled=True)


@pytest.mark.parametrize("world_size, group", [(2, 0), (4, 2)])
def test_interpreted_several_groups(monkeypatch, world_size, group):
    # 300 rows over 128 programs: 2 or 3 a program, one a step (the layout's) or two (forced:
    # the [W, group, row] tile, the last group partial)
    if group:
        monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", str(group))
    run_cases(monkeypatch, lamport_one_shot_streamed_all_reduce, world_size,
              [("add_rms_norm", (300, 8))], all_polled=True)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, lamport_one_shot_streamed_all_reduce)
