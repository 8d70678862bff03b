"""kernels/one_shot_all_reduce.py, interpreted on CPU ranks by its engine algorithm and as a
plain callable, and on GPUs (tests/symm_runs.py)."""

import pytest

from infini_dist.kernels.one_shot_all_reduce import one_shot_all_reduce
from symm_runs import run_cases, run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, one_shot_all_reduce)


def test_interpreted_two_ranks(monkeypatch):
    run_cases(monkeypatch, one_shot_all_reduce, 2, [(pattern, (3, 48)) for pattern in
                                                    ("plain", "add_then_rms_norm", "swiglu_up")])


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, one_shot_all_reduce)
