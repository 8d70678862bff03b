"""kernels/lamport_one_shot.py, interpreted on CPU ranks by its engine algorithm and as a plain
callable (every polled place emptied after each call), and on GPUs (tests/symm_runs.py)."""

import pytest

from infini_dist.kernels.lamport_one_shot import lamport_one_shot_all_reduce
from symm_runs import run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, lamport_one_shot_all_reduce, all_polled=True)


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, lamport_one_shot_all_reduce)
