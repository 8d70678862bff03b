"""kernels/two_shot_polled_gather.py, interpreted on CPU ranks by its engine algorithm and as a
plain callable, also in groups of items, and on GPUs (tests/symm_runs.py)."""

import pytest

from infini_dist.kernels.two_shot_polled_gather import two_shot_polled_gather_all_reduce as kernel
from symm_cases import TRAIN
from symm_runs import run_cases, run_on_gpus, run_standard


def test_interpreted_three_ranks(monkeypatch):
    run_standard(monkeypatch, kernel)


def test_interpreted_in_groups(monkeypatch):
    # Items move in groups of 4, some groups cut short by the end of the tensor.
    monkeypatch.setenv("INFINI_DIST_SYMM_GROUP_ITEMS", "4")
    run_cases(monkeypatch, kernel, 2, [("add_rms_norm", (300, 8)), ("prologue_gelu", (2, 4100)),
                                       ("add_then_rms_norm", (5, 37)), (TRAIN, (300, 8))])


@pytest.mark.multigpu
def test_on_gpus(tmp_path):
    run_on_gpus(tmp_path, kernel)
